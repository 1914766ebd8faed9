"""Distributed iterators in checkpoints: each process's input position, saved beside the arrays.

Each `DistributedIterator` in a saved tree saves its `get_state()` in the step's `iterators`
item, one JSON file per process, since each process reads its own input; restoring sets the
target's iterators to them, only in a job of as many processes. docs/internals.md ("Iterator
positions") says why.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxstrategy._src.checkpoint import stored_leaves, verification
from jaxstrategy._src.checkpoint.format import (
    ITERATOR_STATES_HANDLER_TYPESTR,
    ITERATORS_ITEM,
    PROCESS_FILE,
    CheckpointMismatchError,
    answer_to_former_names,
    process_file,
)
from jaxstrategy._src.checkpoint.placement import Placement
from jaxstrategy._src.core.errors import bullet_list, caller_stacklevel
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.input.datasets import DistributedIterator


def _own_file_name() -> str:
    return process_file(jax.process_index(), jax.process_count())


class OtherProcessCountError(ValueError):
    """Iterator positions saved by a job of another number of processes than this one."""


class IteratorStatesHandler(ocp.CheckpointHandler):  # type: ignore[misc]
    """Orbax's handler of the `iterators` item: this process's iterator states, in its own file.

    `metadata`, `finalize` and `close` are orbax's own, which do nothing.
    """

    @classmethod
    def typestr(cls) -> str:
        """How step metadata names this handler: a fixed name, not the module's path (`format.py`)."""
        return ITERATOR_STATES_HANDLER_TYPESTR

    def save(self, directory: Any, args: IteratorStatesSave) -> None:
        (Path(directory) / _own_file_name()).write_bytes(args.encoded())

    def restore(self, directory: Any, args: IteratorStatesRestore | None = None) -> dict[str, Any]:
        """This process's positions, from a job of as many processes.

        With `args.checksums` (by file name), the file is checked against its checksum before
        it is parsed: a ValueError names a file that differs.

        Raises:
          OtherProcessCountError: the positions were saved by a job of another number of
            processes (the message names both counts).
          ValueError: the file differs from its checksum.
        """
        saved = None if args is None else args.checksums
        directory = Path(directory)
        own = directory / _own_file_name()
        if not own.is_file():
            counts = sorted({int(m[2]) for p in directory.iterdir() if (m := PROCESS_FILE.fullmatch(p.name))})
            if not counts:
                raise FileNotFoundError(f"{directory} holds no iterator positions.")
            saved_by = " or ".join(str(count) for count in counts)
            raise OtherProcessCountError(
                f"the iterator positions were saved by a job of {saved_by} processes, and this job "
                f"has {jax.process_count()}: a position is that of its process's input pipeline, "
                "and a job of another size splits the input otherwise, so it would resume on other "
                f"batches. Restore them in a job of {saved_by} processes"
            )
        data = own.read_bytes()
        if saved is not None:
            verification.check_file(own.name, data, saved)
        return dict(json.loads(data))


@ocp.args.register_with_handler(IteratorStatesHandler, for_save=True)
@dataclasses.dataclass
class IteratorStatesSave(ocp.args.CheckpointArgs):  # type: ignore[misc]
    states: dict[str, Any]

    def encoded(self) -> bytes:
        """The bytes of this process's file: what the handler writes and the checksum is of."""
        return json.dumps(self.states).encode()


@ocp.args.register_with_handler(IteratorStatesHandler, for_restore=True)
@dataclasses.dataclass
class IteratorStatesRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """`checksums`: the files' checksums by name, to check them against; None not to."""

    checksums: dict[str, int] | None = None


# Steps name it by its typestr, which `register_with_handler` above registered; older
# steps by a former name.
answer_to_former_names(IteratorStatesHandler, IteratorStatesSave, IteratorStatesRestore)


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
    """The handler of the item, for the checkpoint manager."""
    return {ITERATORS_ITEM: IteratorStatesHandler()}


def own_file(args: IteratorStatesSave) -> dict[str, bytes]:
    """The file this process writes for `args`, by its path in the step, for its checksum."""
    return {f"{ITERATORS_ITEM}/{_own_file_name()}": args.encoded()}


def _is_iterator(leaf: Any) -> bool:
    return isinstance(leaf, DistributedIterator)


def take_iterators(tree: PyTree) -> tuple[PyTree, dict[str, DistributedIterator]]:
    """`tree` with its iterators replaced by None, and the iterators by their stored path."""
    iterators: dict[str, DistributedIterator] = {}

    def take(path: tuple[Any, ...], leaf: Any) -> Any:
        if _is_iterator(leaf):
            iterators[stored_leaves.path_string(path)] = leaf
            return None
        return leaf

    return jax.tree_util.tree_map_with_path(take, tree), iterators


def save_args(tree: PyTree) -> tuple[PyTree, IteratorStatesSave | None]:
    """`tree` without its iterators, and the item saving their states now (None without any).

    The states are taken at once: a background save must not see the iterators move on.

    Raises:
      TypeError: an iterator's dataset reads a one-shot iterator, whose position could not be
        restored.
    """
    tree, iterators = take_iterators(tree)
    if not iterators:
        return tree, None
    return tree, IteratorStatesSave({path: it.get_state() for path, it in iterators.items()})


def _filled_where_none(tree: PyTree, values: dict[str, Any]) -> PyTree:
    """`tree` with `values` put where it holds None at their paths."""

    def fill(path: tuple[Any, ...], leaf: Any) -> Any:
        name = stored_leaves.path_string(path)
        return values.get(name, leaf) if leaf is None else leaf

    return jax.tree_util.tree_map_with_path(fill, tree, is_leaf=lambda leaf: leaf is None)


def restoring_positions(
    read: Callable[[Placement, PyTree], PyTree],
    manager: ocp.CheckpointManager,
    step: int,
    where: str,
    *,
    mismatch: type[Exception],
    corrupt: type[Exception],
    saved_checksums: dict[str, int] | None = None,
) -> Callable[[Placement, PyTree], PyTree]:
    """`read` (a step's arrays placed by a `Placement`, checked against a target) that also restores the
    iterators of the target to their saved positions, or gives the saved states without one.

    The positions are read (checked against `saved_checksums`, by file name, when given) and
    matched to the target's iterators before any array is read; the iterators are set only once
    the arrays are read.
    """

    def read_with_positions(placement: Placement, target: PyTree) -> PyTree:
        target, iterators = take_iterators(target)
        states: dict[str, Any] = {}
        if (Path(manager.directory) / str(step) / ITERATORS_ITEM).is_dir():
            try:
                args = ocp.args.Composite(**{ITERATORS_ITEM: IteratorStatesRestore(saved_checksums)})
                restored = manager.restore(step, args=args)
                states = dict(restored[ITERATORS_ITEM])
            except OtherProcessCountError as error:
                if target is not None:
                    raise CheckpointMismatchError(
                        f"Cannot restore the iterator positions of the checkpoint at {where}: {error}; "
                        "or, to restore the arrays alone (onto any job), restore without a target: "
                        "the iterators' places then hold None."
                    ) from None
                warnings.warn(
                    f"The iterator positions of the checkpoint at {where} are not restored: {error}. "
                    "Their places in the restored tree hold None.",
                    stacklevel=caller_stacklevel(),
                )
            except Exception as error:
                raise corrupt(
                    f"Cannot read the iterator positions of the checkpoint at {where}: {error}"
                ) from error
        if target is not None:
            problems = [
                f"{path}: the target holds a DistributedIterator, the checkpoint no iterator position"
                for path in sorted(iterators.keys() - states.keys())
            ] + [
                f"{path}: the checkpoint holds an iterator position, the target no DistributedIterator"
                for path in sorted(states.keys() - iterators.keys())
            ]
            if problems:
                raise mismatch(
                    f"The target does not match the checkpoint at {where}; nothing was restored:"
                    f"{bullet_list(problems)}"
                )
        restored_tree = read(placement, target)
        if target is None:
            return _filled_where_none(restored_tree, states)
        for path, iterator in iterators.items():
            iterator.set_state(states[path])
        return _filled_where_none(restored_tree, iterators)

    return read_with_positions
