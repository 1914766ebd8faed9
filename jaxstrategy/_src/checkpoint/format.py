"""What a jaxstrategy checkpoint looks like on disk: its steps, their items, its format numbers, its errors.

Both sides of the checkpoint room depend on this module and not on each other: the save side
(`writer.py`, `lock.py`) and the restore side (`restore.py`, `verification.py`, `block_sums.py`).
The handlers of jaxstrategy's own items name themselves in step metadata by fixed strings, so
that moving code does not change what a step says. docs/internals.md ("A step on disk") has the
layout; docs/checkpoints.md ("Formats") the table of format numbers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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

# Checkpoint formats, by number (the table in docs/checkpoints.md, "Formats"). A step records the
# number of its format in orbax's step metadata, its `custom_metadata`, under FORMAT_KEY; steps
# saved before the numbering have none and are read by what they hold.
FORMAT_KEY = "jaxstrategy_format"
# jaxstrategy 0.1: a single `checksums/checksums.json` of block sums of whole leaves (`block_sums.py`).
BLOCK_SUMS_FORMAT = 1
# A CRC32C file per process in `checksums/`, and their record in the step metadata (`checksums.py`).
CRC32C_FORMAT = 2
# What saves write, and the newest format this version reads.
NEWEST_FORMAT = CRC32C_FORMAT

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


def format_record() -> dict[str, int]:
    """What every step saved now holds in its `custom_metadata`: the number of its format."""
    return {FORMAT_KEY: NEWEST_FORMAT}


def check_format(custom_metadata: Mapping[str, Any] | None, where: str) -> None:
    """Refuse the step at `where` (`step 3 in /ckpt`) if its step metadata's `custom_metadata`
    gives a format this version cannot read; a step without a number is read by what it holds.

    Raises:
      CorruptCheckpointError: the step's format number is newer than `NEWEST_FORMAT`, or is not
        a format number.
    """
    number = (custom_metadata or {}).get(FORMAT_KEY)
    if number is None:
        return
    if not is_int(number) or number < 1:
        raise CorruptCheckpointError(
            f"Cannot read the checkpoint at {where}: its format number ({FORMAT_KEY!r} in its "
            f"_CHECKPOINT_METADATA) is {number!r}, not an int >= 1, so that file was damaged or "
            "changed after the save. Restore another step."
        )
    if number > NEWEST_FORMAT:
        raise CorruptCheckpointError(
            f"Cannot read the checkpoint at {where}: it is of checkpoint format {number}, and this "
            f"version of jaxstrategy reads formats up to {NEWEST_FORMAT}; a newer jaxstrategy saved "
            "it. Upgrade jaxstrategy to restore it, or restore a step of an older format."
        )


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
