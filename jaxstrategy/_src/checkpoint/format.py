"""What a jaxstrategy checkpoint looks like on disk: its steps, their items, and its errors.

A checkpoint directory holds one subdirectory per step, named `0`, `1`, ... (orbax's standard
step names, without zero padding). Each step holds these items:

- `state`: the arrays (orbax's StandardCheckpointHandler), as `stored_leaves.py` stores them;
- `prng_keys`: a JSON map from the paths of typed PRNG key leaves to their implementation;
- `zero_size_shapes`: a JSON map from the paths of arrays with no elements to their true shape,
  written only when there are some (orbax cannot store such an array);
- `checksums`: one file per process (`process_<i>-of-<n>.json`), the CRC32C of each array shard
  that process wrote and of each JSON item (`checksums.py`); absent from steps saved before
  jaxstrategy wrote them, and a single `checksums.json` of whole leaves in steps of 0.1;
- `iterators`: each process's input position (`iterators.py`), one file per process named the
  same way, only when the tree held iterators.

A step saved with checksums says so in orbax's own step metadata (`_CHECKPOINT_METADATA`), in
its `custom_metadata`, under `jaxstrategy_checksums` (`checksums.py` says why there).

Only a step directory holding `state` and `prng_keys` counts as a step. The handlers of the two
jaxstrategy items name themselves in each step's orbax metadata by the fixed strings below, not
by their module paths, so that a move inside jaxstrategy does not change what a step says; plain
orbax finds them by those strings once jaxstrategy's checkpoint module is imported.

The restore side (`restore.py`) and the save side (`writer.py` and `lock.py`) both depend on
this module, and not on each other; `checkpointer.py`, the front (`Checkpointer`, `save`,
`restore`), uses both. `tests/test_layering.py` holds them to that.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp

from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.errors import JaxStrategyError

STATE_ITEM = "state"
PRNG_KEYS_ITEM = "prng_keys"
ZERO_SIZE_SHAPES_ITEM = "zero_size_shapes"
CHECKSUMS_ITEM = "checksums"
ITERATORS_ITEM = "iterators"
# The items without which a step directory is no step.
REQUIRED_ITEMS = (STATE_ITEM, PRNG_KEYS_ITEM)

# How the handlers of the jaxstrategy items are named in orbax's step metadata, and how steps
# saved by jaxstrategy 0.1.0 named them (their module paths then).
CHECKSUM_HANDLER_TYPESTR = "jaxstrategy.checkpoint.ChecksumHandler"
ITERATOR_STATES_HANDLER_TYPESTR = "jaxstrategy.checkpoint.IteratorStatesHandler"
FORMER_TYPESTRS = {
    CHECKSUM_HANDLER_TYPESTR: ("jaxstrategy._src.checksums.ChecksumHandler",),
    ITERATOR_STATES_HANDLER_TYPESTR: ("jaxstrategy._src.iterator_checkpoint.IteratorStatesHandler",),
}

# The names orbax's standard step format gives steps: 0, 1, 2, ... without zero padding.
STEP_NAME = re.compile(r"0|[1-9][0-9]*")
# How items that hold one file per process (`iterators`, `checksums`) name them, as Grain's own
# orbax handler names its files.
PROCESS_FILE = re.compile(r"process_(0|[1-9][0-9]*)-of-([1-9][0-9]*)\.json")


def process_file(process: int, count: int) -> str:
    """The name of the file of process `process` of `count` in a per-process item."""
    return f"process_{process}-of-{count}.json"


class CheckpointNotFoundError(JaxStrategyError, FileNotFoundError):
    """The directory, or the requested step in it, holds no complete checkpoint."""


class CorruptCheckpointError(JaxStrategyError, ValueError):
    """A checkpoint exists but cannot be read: truncated, corrupted, or written by something else."""


class CheckpointMismatchError(JaxStrategyError, ValueError):
    """A `target` tree differs from the checkpoint in structure, shapes or dtypes; or the job
    restoring iterator positions has another number of processes than the one that saved them."""


def is_complete(step_directory: Path) -> bool:
    """Whether `step_directory` holds a whole jaxstrategy step (orbax lists steps by name alone)."""
    # Orbax renames a step into place once written, so a step with both items is whole.
    return all((step_directory / item).is_dir() for item in REQUIRED_ITEMS)


def check_step(step: Any, caller: str) -> None:
    """Refuse a step number that is not an int >= 0 (numpy ints are fine)."""
    if not is_int(step, numpy=True) or step < 0:
        raise ValueError(f"{caller}: step must be an int >= 0; got {step!r}.")


def answer_to_former_names(handler: type, save_args: type, restore_args: type) -> None:
    """Let plain orbax restore the items of steps that name `handler` by a former name.

    `ocp.CheckpointManager(directory).restore(step)`, given no arguments, finds each item's
    handler by the name the step's metadata gives it, in the registry that
    `ocp.args.register_with_handler` fills. For each former name of `handler` this registers a
    subclass answering to that name, with argument classes of its own (orbax maps each argument
    class to one handler).
    """
    for former in FORMER_TYPESTRS[handler.typestr()]:  # type: ignore[attr-defined]
        alias = type(
            f"{handler.__name__}ByFormerName",
            (handler,),
            {
                "typestr": classmethod(lambda cls, name=former: name),
                "__qualname__": f"{handler.__qualname__}ByFormerName",
                "__doc__": f"{handler.__name__}, by the name {former!r} that older steps give it.",
            },
        )
        ocp.args.register_with_handler(alias, for_save=True)(type(save_args.__name__, (save_args,), {}))
        ocp.args.register_with_handler(alias, for_restore=True)(
            type(restore_args.__name__, (restore_args,), {})
        )
