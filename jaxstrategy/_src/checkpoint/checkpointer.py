"""`Checkpointer`, `save` and `restore`: numbered checkpoints of a training loop, saved with orbax.

The front of the checkpoint room. It numbers and lists the steps (only complete ones count, since
orbax lists them by name alone), refuses trees whose leaves would be stored under one name, and
hands the work to the save side (`writer.py`, `checksums.py`) and the restore side
(`restore.py`). docs/internals.md ("Checkpoints") says what a step holds and why.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxstrategy._src.checkpoint import checksums, iterators, stored_leaves
from jaxstrategy._src.checkpoint.format import (
    CHECKSUMS_ITEM,
    ITERATORS_ITEM,
    PRNG_KEYS_ITEM,
    REQUIRED_ITEMS,
    STATE_ITEM,
    STEP_NAME,
    ZERO_SIZE_SHAPES_ITEM,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    check_step,
    format_record,
    is_complete,
)
from jaxstrategy._src.checkpoint.placement import placement_of
from jaxstrategy._src.checkpoint.restore import (
    plain_orbax_item,
    plain_orbax_items,
    restore_item,
    restore_step,
    step_checksums,
    step_metadata,
)
from jaxstrategy._src.checkpoint.writer import DirectoryWriter
from jaxstrategy._src.core.arguments import check_int
from jaxstrategy._src.core.errors import bullet_list, caller_stacklevel
from jaxstrategy._src.core.tree_checks import require_array_leaves
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.steps import nnx_objects
from jaxstrategy._src.strategies.strategy import Strategy, get_strategy


class Checkpointer:
    """Numbered checkpoints of a training loop in one directory, saved in the background.

    `save(step, tree)` returns once the arrays are copied off the device; orbax writes the files
    in a background thread, and the next `save`, `wait()` or `close()` waits for that. Keeps the
    newest `max_to_keep` steps (all when None) and saves only steps that are multiples of
    `save_interval_steps`. Step directories that hold no complete checkpoint (an empty `5/`,
    say) are skipped with a warning.

    Args:
      directory: where the steps live; created if missing. `~` stands for the home directory.
      max_to_keep: how many of the newest steps to keep, or None for all.
      save_interval_steps: `save` writes only steps divisible by this (and returns False for
        the others).

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxstrategy
      >>> from jaxstrategy import checkpoint
      >>> with checkpoint.Checkpointer(tempfile.mkdtemp(), max_to_keep=2) as checkpointer:
      ...     for step in range(3):
      ...         _ = checkpointer.save(step, {'w': jnp.full(2, step)})
      ...     checkpointer.wait()
      ...     print(checkpointer.all_steps(), checkpointer.restore()['w'].tolist())
      [1, 2] [2, 2]
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
    ):
        check_int(max_to_keep, f"Checkpointer(max_to_keep={max_to_keep!r})", at_least=1, allow_none=True)
        check_int(
            save_interval_steps, f"Checkpointer(save_interval_steps={save_interval_steps!r})", at_least=1
        )
        self._directory = _directory_path(directory, "Checkpointer()")
        self._writer = DirectoryWriter(self._directory)
        with self._writer.writing(f"Checkpointer(): could not create the directory {self._directory}"):
            self._manager = _new_manager(
                self._directory, create=True, max_to_keep=max_to_keep, interval=save_interval_steps
            )
        self._closed = False
        self._saving: int | None = None  # The step of the save in flight, if any.

    @property
    def directory(self) -> Path:
        """The checkpoint directory, absolute."""
        return self._directory

    def save(self, step: int, tree: PyTree, *, force: bool = False) -> bool:
        """Start saving `tree` as `step`; return whether it is saved (False when skipped by the interval).

        Args:
          step: the step number, an int >= 0, greater than every saved step.
          tree: a pytree of arrays (typed PRNG keys included); Flax NNX objects in it (a Module,
            an Optimizer) are saved as their state.
          force: save even when `step` is not a multiple of `save_interval_steps`.

        Raises:
          TypeError: a leaf is not an array.
          ValueError: `tree` is a bare array or holds no array; two of its leaves would be stored
            under one name (such as `{'a.b': x, 'a': {'b': y}}`); `step` is below the newest step.
          FileExistsError: `step` is saved already, or its directory exists holding no checkpoint.
          RuntimeError: the Checkpointer is closed.
          CheckpointLockedError: (a `RuntimeError`) another writer (another process, or another
            Checkpointer of this one) has a save into the directory in flight.
          OSError: the step, or the one saved before it, could not be written (no space, a
            read-only filesystem); the message names the directory and the cause.
        """
        if self._closed:
            raise RuntimeError(
                f"Checkpointer.save(): this Checkpointer of {self._directory} is closed (by close() "
                "or by leaving its `with` block), so it cannot save. Save before closing it, or "
                f"create a new Checkpointer({str(self._directory)!r})."
            )
        check_step(step, "Checkpointer.save()")
        found = nnx_objects.find_objects(tree)
        if found is not None:  # Flax NNX objects are saved as their state.
            tree = nnx_objects.with_states(found)
        # DistributedIterators: their positions, taken now, go in an item of their own.
        tree, iterator_positions = iterators.save_args(tree)
        _check_savable(tree)
        _check_distinct_names(tree)
        if force or self._manager.should_save(step):
            self._start_writing("Checkpointer.save()")
        try:
            saved = self._save(step, tree, iterator_positions, force)
        except BaseException:
            self._writer.release()  # Nothing of this save is in flight.
            raise
        if saved:
            self._saving = step
        else:
            self._writer.release()
        return saved

    def _save(
        self,
        step: int,
        tree: PyTree,
        iterator_positions: iterators.IteratorStatesSave | None,
        force: bool,
    ) -> bool:
        """Check that `step` is new, and start saving `tree` there."""
        if step in self._manager.all_steps():
            raise FileExistsError(
                f"Checkpointer.save(): step {step} is already saved in {self._directory}; steps must "
                "grow. Save under a new step number, or delete that step's directory first."
            )
        step_directory = self._directory / str(step)
        if step_directory.exists():
            raise FileExistsError(
                f"Checkpointer.save(): {step_directory} exists but holds no complete checkpoint "
                "(it is empty, unfinished, or written by something else), so step "
                f"{step} cannot be saved there. Delete it, or save under another step number."
            )
        latest = self._manager.latest_step()
        if latest is not None and step < latest:
            raise ValueError(
                f"Checkpointer.save(): step {step} is older than the newest saved step {latest} in "
                f"{self._directory}; steps must grow. Save under a step above {latest}."
            )
        state, prng_impls = stored_leaves.split_prng_keys(tree)
        state, zero_size_shapes = stored_leaves.replace_zero_size(state)
        items = {STATE_ITEM: ocp.args.StandardSave(state), PRNG_KEYS_ITEM: ocp.args.JsonSave(prng_impls)}
        if zero_size_shapes:  # Only then, so checkpoints without any read as they always have.
            items[ZERO_SIZE_SHAPES_ITEM] = ocp.args.JsonSave(zero_size_shapes)
        if iterator_positions is not None:
            items[ITERATORS_ITEM] = iterator_positions
        # Committed with the step, in its `_CHECKPOINT_METADATA` (docs/internals.md says why there).
        step_metadata = format_record()
        # Only for a step orbax writes: summing copies every shard to the host.
        if checksums.write_checksums and (force or self._manager.should_save(step)):
            orbax_json: dict[str, Any] = {PRNG_KEYS_ITEM: prng_impls}
            if zero_size_shapes:
                orbax_json[ZERO_SIZE_SHAPES_ITEM] = zero_size_shapes
            own_files = {} if iterator_positions is None else iterators.own_file(iterator_positions)
            items[CHECKSUMS_ITEM] = checksums.save_args(state, orbax_json=orbax_json, own_files=own_files)
            step_metadata |= checksums.step_record()
        with self._writer.writing(self._write_failure(step)):
            saved = self._manager.save(
                step, args=ocp.args.Composite(**items), force=force, custom_metadata=step_metadata
            )
            return bool(saved)

    def _start_writing(self, caller: str) -> None:
        """Finish the save in flight, then lock the directory for the next one.

        The lock is held per save, from `save` until the save is on disk (`wait`, the next
        `save`, `restore` or `close`), rather than for the Checkpointer's life: a lock file at
        rest would sit among the step directories, where a listing that reads every name as a
        step number would trip on it, as it does on orbax's temporary directory during a save.
        """
        if self._saving is not None:
            self.wait()  # Orbax's save would too; here a failure is reported as the earlier step's.
        self._hold(caller)
        self._writer.before_save()

    def _hold(self, caller: str) -> None:
        if self._writer.hold(caller):
            self._manager.reload()  # Steps another writer saved since this one last looked.

    def wait(self) -> None:
        """Block until every save started so far is on disk, and let other writers in.

        Raises:
          OSError: the save could not be written (no space, a read-only filesystem); the message
            names the step, the directory and the cause.
        """
        step, self._saving = self._saving, None
        try:
            with self._writer.writing(self._write_failure(step)):
                self._manager.wait_until_finished()
        finally:
            if step is not None:
                self._writer.release()

    def _write_failure(self, step: int | None) -> str:
        what = "a step" if step is None else f"step {step}"
        return f"Checkpointer.save(): could not write {what} to {self._directory}"

    def latest_step(self) -> int | None:
        """The newest complete step, or None when there is none.

        Warns (UserWarning) when it skips step directories that hold no complete checkpoint.
        """
        steps, strays = self._steps_and_strays()
        self._warn_skipped(strays, "Checkpointer.latest_step()")
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The complete steps, oldest first.

        Warns (UserWarning) when it skips step directories that hold no complete checkpoint.
        """
        steps, strays = self._steps_and_strays()
        self._warn_skipped(strays, "Checkpointer.all_steps()")
        return steps

    def _steps_and_strays(self) -> tuple[list[int], list[int]]:
        """The complete steps and the stray step directories' numbers, both oldest first."""
        self._manager.reload()
        return sorted(int(step) for step in self._manager.all_steps()), _stray_steps(self._directory)

    def _warn_skipped(self, strays: list[int], caller: str) -> None:
        if strays:
            names = [str(self._directory / str(step)) for step in strays]
            warnings.warn(
                f"{caller}: skipping {names}: step directories that hold no complete checkpoint "
                "(empty, unfinished, or written by something else). Delete them, or move them out "
                f"of {self._directory}, to silence this warning.",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    def restore(
        self,
        step: int | None = None,
        *,
        strategy: Strategy | None = None,
        target: PyTree = None,
        verify: bool = True,
    ) -> PyTree:
        """Restore `step` (the newest when None) onto `strategy` (the current one when None).

        Every leaf is read directly onto the strategy, committed: onto its `sharding`, or on a
        `ShardedStrategy` onto the leaf's layout, `strategy.layout_of` of the target's leaf at its
        path (of the saved leaf without a target), each device reading only its part, so that a
        model bigger than one device restores. With a `target` (a pytree of arrays or
        `jax.ShapeDtypeStruct`s, such as an nnx state or an optax state, or Flax NNX objects,
        which get their state in place and come back themselves), the result has the target's
        structure, and every difference in paths, shapes or dtypes is reported at once, before
        anything is read; without one, the saved structure comes back as nested dicts and lists.

        The newest step is the newest complete one: step directories that hold no complete
        checkpoint are skipped with a warning (UserWarning); asking for one by `step` is an error.
        A directory written by orbax alone (`ocp.StandardCheckpointer`, which has no steps, or an
        `ocp.CheckpointManager` with its `default` item) is restored the same way.

        While `jax_enable_x64` is off, 64-bit leaves come back 32-bit, as JAX holds them: integers
        only when every value fits, floats with a warning (UserWarning) naming them.

        Every byte read is checked against the checksums saved with the step: a CRC32C of each
        array shard as saved (checked from the restored arrays whatever their sharding, which
        reads them once more: about 10 ms per 100 MiB on CPU) and of each JSON item (PRNG key
        implementations, zero-size shapes, iterator positions). A step saved with checksums that
        lacks some is corrupt. Steps saved before jaxstrategy wrote checksums, and checkpoints
        written by orbax alone, have none, and restore unchecked; those of jaxstrategy 0.1 have
        an older kind, still checked. TensorFlow checks a CRC32C of each tensor, always.

        Args:
          step: the step to restore; None for the newest.
          strategy: where to put the leaves; None for the current strategy.
          target: a pytree the result should match, as above; None for the saved structure.
          verify: check the leaves against their saved checksums. False skips the check, to read
            a checkpoint known to be damaged, or to save its cost.

        Raises:
          CheckpointNotFoundError: (a `FileNotFoundError`) no such step, or no steps at all.
          CheckpointMismatchError: (a `ValueError`) `target` differs from the checkpoint.
          CorruptCheckpointError: (a `ValueError`) the step cannot be read, its directory holds
            no complete checkpoint, a leaf's bytes or a JSON item do not match their saved
            checksums (the message names every such leaf and part of one, or the item), or its
            checksums are missing or incomplete.
          OverflowError: an int64 or uint64 leaf holds values beyond 32 bits while
            `jax_enable_x64` is off.
        """
        self.wait()
        plain = plain_orbax_items(self._directory)
        if plain is None:
            step = self._complete_step(step)
            where = f"step {step} in {self._directory}"
            metadata = step_metadata(self._manager, step, where)
            # Read and checked to be whole before any other item is read.
            saved = step_checksums(metadata, self._directory / str(step), where) if verify else None
            # DistributedIterators in the target are set to their saved positions.
            read = iterators.restoring_positions(
                functools.partial(restore_step, self._manager, metadata, step, where, saved_checksums=saved),
                self._manager,
                step,
                where,
                mismatch=CheckpointMismatchError,
                corrupt=CorruptCheckpointError,
                saved_checksums=None if saved is None else saved.files_in(ITERATORS_ITEM),
            )
        else:
            read = functools.partial(restore_item, plain_orbax_item(plain, step, self._directory))
        strategy = get_strategy() if strategy is None else strategy
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"Checkpointer.restore(): strategy must be a jaxstrategy strategy; got {strategy!r}."
            )
        found = nnx_objects.find_objects(target)
        if found is None:
            return read(placement_of(strategy), target)
        # Flax NNX objects in the target get the restored state, in place.
        restored = read(placement_of(strategy), nnx_objects.with_states(found))
        return nnx_objects.update_from_states(found, restored)

    def _complete_step(self, step: int | None) -> int:
        """`step`, or the newest when None, checked to be a complete step."""
        steps, strays = self._steps_and_strays()
        if step is None:
            self._warn_skipped(strays, "Checkpointer.restore()")
            if not steps:
                raise CheckpointNotFoundError(_no_steps_message(self._directory))
            step = steps[-1]
        check_step(step, "Checkpointer.restore()")
        if step in strays:
            raise CorruptCheckpointError(
                f"Cannot read the checkpoint at step {step} in {self._directory}: "
                f"{self._directory / str(step)} holds no complete checkpoint (it is empty, "
                "unfinished, or written by something else; a step holds the items "
                f"{list(REQUIRED_ITEMS)}). Restore one of the complete steps {steps}, or delete it."
            )
        if step not in steps:
            raise CheckpointNotFoundError(
                f"No complete checkpoint for step {step} in {self._directory}; it holds steps {steps}."
            )
        return step

    def close(self) -> None:
        """Wait for pending saves, release orbax's resources and the directory. Safe to call twice.

        A closed Checkpointer can still restore and list steps, but not save. The directory's lock,
        held while a save is in flight, is released (without close, when the Checkpointer is
        garbage collected or the process exits).

        Raises:
          OSError: a pending save could not be written; see `wait`.
        """
        try:
            self.wait()
        finally:
            try:
                self._manager.close()
            finally:
                self._writer.close()
                self._closed = True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpointer({str(self._directory)!r})"


def save(directory: str | os.PathLike[str], tree: PyTree, *, step: int | None = None) -> int:
    """Save `tree` to `directory` and return the step it was saved as; returns when it is on disk.

    Args:
      directory: the checkpoint directory; created if missing. `~` stands for the home directory.
      tree: a pytree of arrays (typed PRNG keys included), no two of whose leaves have paths that
        read the same with '.' or '/' between keys.
      step: the step number; None means one more than the newest step directory, complete or
        not (0 for the first).

    Raises:
      TypeError: a leaf is not an array.
      ValueError: `directory` is empty; two leaves would be stored under one name.
      FileExistsError: `step` is saved already.

    Example:
      >>> import tempfile, jax.numpy as jnp
      >>> from jaxstrategy import checkpoint
      >>> directory = tempfile.mkdtemp()
      >>> first = checkpoint.save(directory, {'w': jnp.ones(3)})
      >>> first, checkpoint.save(directory, {'w': jnp.zeros(3)})
      (0, 1)
      >>> checkpoint.restore(directory)['w'].tolist()
      [0.0, 0.0, 0.0]
    """
    path = _directory_path(directory, "checkpoint.save()")
    with Checkpointer(path) as checkpointer:
        checkpointer._hold("checkpoint.save()")  # Before numbering, so that no other writer can.
        if step is None:
            # Past stray step directories too, whose names a save could not take.
            taken = [max(numbers) for numbers in checkpointer._steps_and_strays() if numbers]
            step = max(taken) + 1 if taken else 0
        checkpointer.save(step, tree, force=True)
        checkpointer.wait()
    return step


def restore(
    directory: str | os.PathLike[str],
    *,
    strategy: Strategy | None = None,
    target: PyTree = None,
    step: int | None = None,
    verify: bool = True,
) -> PyTree:
    """Restore a checkpoint from `directory` onto `strategy` (the current strategy when None).

    See `Checkpointer.restore`; this is the same for one call, without creating `directory`.
    Every array shard and JSON item is checked against the CRC32C saved with it (`verify=False`
    skips that); checkpoints saved before jaxstrategy wrote checksums, and those written by orbax
    alone, have none and restore unchecked.

    Raises:
      ValueError: `directory` is empty.
      CheckpointNotFoundError: (a `FileNotFoundError`) `directory` does not exist, holds no
        checkpoint, or lacks `step`.
      CheckpointMismatchError: (a `ValueError`) `target` differs from the checkpoint.
      CorruptCheckpointError: (a `ValueError`) the checkpoint cannot be read, a leaf's bytes or
        a JSON item do not match their saved checksums, or its checksums are missing or
        incomplete.
      OverflowError: a 64-bit integer leaf does not fit 32 bits while `jax_enable_x64` is off.

    Example:
      >>> import tempfile, jax.numpy as jnp, jaxstrategy
      >>> from jaxstrategy import checkpoint
      >>> directory = tempfile.mkdtemp()
      >>> _ = checkpoint.save(directory, {'w': jnp.arange(3.0)})
      >>> strategy = jaxstrategy.OneDeviceStrategy('/cpu:0')
      >>> target = {'w': jnp.zeros(3)}
      >>> restored = checkpoint.restore(directory, strategy=strategy, target=target)
      >>> restored['w'].tolist(), restored['w'].committed
      ([0.0, 1.0, 2.0], True)
    """
    path = _directory_path(directory, "checkpoint.restore()")
    if not path.is_dir():
        raise CheckpointNotFoundError(
            f"No checkpoint directory at {path}: it does not exist or is not a directory."
        )
    with Checkpointer(path) as checkpointer:
        return checkpointer.restore(step, strategy=strategy, target=target, verify=verify)


def _directory_path(directory: str | os.PathLike[str], caller: str) -> Path:
    """`directory` with `~` expanded, made absolute; an empty one is an error, not the current one."""
    text = os.fspath(directory)
    if not text:
        raise ValueError(
            f"{caller}: directory is empty ({directory!r}); expected the path of a checkpoint "
            "directory. Pass one, such as 'checkpoints', or '.' for the current directory."
        )
    return Path(os.path.expanduser(text)).absolute()


def _new_manager(
    directory: Path, *, create: bool, max_to_keep: int | None, interval: int
) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep,
        save_interval_steps=interval,
        create=create,
        step_name_format=_CompleteSteps(),
    )
    handlers = {
        STATE_ITEM: ocp.StandardCheckpointHandler(),
        PRNG_KEYS_ITEM: ocp.JsonCheckpointHandler(),
        ZERO_SIZE_SHAPES_ITEM: ocp.JsonCheckpointHandler(),
        CHECKSUMS_ITEM: checksums.ChecksumHandler(),
        **iterators.item_handlers(),
    }
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


class _CompleteSteps:
    """Orbax's standard step names, listing only the steps that hold both items.

    Orbax takes its newest step, its retention and its save interval from `find_all`, so a stray
    step directory left out here is out of all of them, and is never deleted by retention.
    """

    def __init__(self) -> None:
        self._standard = ocp.step.standard_name_format()

    def build_name(self, step: int) -> str:
        return str(self._standard.build_name(step))

    def find_all(self, base_path: Any) -> Iterator[Any]:
        return (meta for meta in self._standard.find_all(base_path) if is_complete(Path(meta.path)))

    def find_step(self, base_path: Any, step: int) -> Any:
        return self._standard.find_step(base_path, step)


def _stray_steps(directory: Path) -> list[int]:
    """The numbers of the entries of `directory` named like a step that are not a complete one."""
    if not directory.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in directory.iterdir()
        if STEP_NAME.fullmatch(entry.name) and not is_complete(entry)
    )


def _check_savable(tree: PyTree) -> None:
    require_array_leaves(tree, caller="Checkpointer.save()", name="tree")
    leaves = jax.tree.leaves(tree)
    if not leaves or jax.tree_util.treedef_is_leaf(jax.tree.structure(tree)):
        what = "holds no array" if not leaves else "is a single array, not a container of arrays"
        raise ValueError(
            f"Checkpointer.save(): the tree {what}. Save a dict (or another pytree) of arrays, "
            "such as {'params': params}."
        )


def _check_distinct_names(tree: PyTree) -> None:
    """Refuse a tree two of whose leaves would be stored under one name, to restore as one.

    Orbax names a leaf by its keys joined with '.', and the maps of PRNG keys and zero-size shapes
    by `stored_leaves.path_string` ('/'), so `{'a.b': x, 'a': {'b': y}}` would restore `y` twice. Escaping the
    keys instead would change the names of existing checkpoints' leaves.
    """
    first: dict[tuple[str, str], str] = {}  # (separator, name) -> the first leaf stored so
    clashes = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shown = f"tree{jax.tree_util.keystr(path)}"
        for separator in (".", "/"):
            name = separator.join(stored_leaves.path_parts(path))
            if (separator, name) in first:
                clashes.append(f"{first[separator, name]} and {shown} are both stored as {name!r}")
                break
            first[separator, name] = shown
    if clashes:
        raise ValueError(
            "Checkpointer.save(): leaves of the tree would be stored under the same name, and restore "
            f"as one another:{bullet_list(clashes)}\nRename the keys so that no key holds '.' or '/' "
            "where another leaf's nested keys spell the same name."
        )


def _no_steps_message(directory: Path) -> str:
    entries = sorted(entry.name for entry in directory.iterdir())[:10] if directory.is_dir() else []
    return (
        f"{directory} is not a checkpoint directory: it holds no complete saved step "
        f"(it contains {entries or 'nothing'}). Save with jaxstrategy.checkpoint first, or pass "
        "the directory you saved to."
    )
