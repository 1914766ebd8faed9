"""Every private orbax name jaxstrategy relies on, each reached through the places it has been seen.

As in `jax_compat.py`, each entry lists its paths, the preferred first, tagged with the orbax
versions seen having it, and a fallback value for where none resolves. Names are read from the
modules `import orbax.checkpoint` has loaded, importing nothing: this may run lazily, while an
input thread runs. tests/core/test_orbax_compat.py checks each first path and fallback.
docs/internals.md, "Values", tells what each name is for.
"""

from __future__ import annotations

import gc
import logging
import re
import sys
import traceback
from typing import Any

from absl import logging as absl_logging

# The suffix of the directory orbax writes step N into (`N.orbax-checkpoint-tmp`; versions before
# 0.5 add `-<timestamp>`). In `atomicity_types` from 0.11 on.
TMP_DIR_SUFFIX_PATHS = ("orbax.checkpoint._src.path.atomicity_types:TMP_DIR_SUFFIX",)
TMP_DIR_SUFFIX_FALLBACK = ".orbax-checkpoint-tmp"
# The file marking a pytree item (`StandardCheckpointer` writes it beside the arrays).
PYTREE_METADATA_FILE_PATHS = ("orbax.checkpoint._src.path.format_utils:PYTREE_METADATA_FILE",)
PYTREE_METADATA_FILE_FALLBACK = "_METADATA"
# The item a `CheckpointManager` saving one unnamed item writes: public module, constant.
DEFAULT_ITEM_NAME_PATHS = ("orbax.checkpoint.checkpoint_manager:DEFAULT_ITEM_NAME",)
DEFAULT_ITEM_NAME_FALLBACK = "default"
# The coroutine that reads one array's part and puts it on its device.
READ_COROUTINE_PATHS = ("orbax.checkpoint._src.serialization.serialization:_read_array_index_and_device_put",)
READ_COROUTINE_FALLBACK = "_read_array_index_and_device_put"
# What picks the parts of a `jax.Array` a process writes (`written_parts`). In `replica_slices`
# from 0.11 on.
REPLICA_SLICES_PATHS = ("orbax.checkpoint._src.serialization.replica_slices:get_replica_slices",)


def lookup(paths: tuple[str, ...]) -> tuple[str, Any] | None:
    """The first of `paths` (`'module:attribute.attribute'`) found among loaded modules, with what
    it names; None when none is."""
    for path in paths:
        module_name, _, attributes = path.partition(":")
        found: Any = sys.modules.get(module_name)
        for attribute in attributes.split("."):
            found = getattr(found, attribute, None)
        if found is not None:
            return path, found
    return None


def _resolved(paths: tuple[str, ...], fallback: str) -> str:
    found = lookup(paths)
    if found is None:
        return fallback
    value = found[1]
    # A function stands for its name (what an unraisable coroutine reports as `__qualname__`).
    return str(getattr(value, "__qualname__", value))


def _constants() -> tuple[str, str, str, str]:
    import orbax.checkpoint  # noqa: F401  (imports the modules named above)

    return (
        _resolved(TMP_DIR_SUFFIX_PATHS, TMP_DIR_SUFFIX_FALLBACK),
        _resolved(PYTREE_METADATA_FILE_PATHS, PYTREE_METADATA_FILE_FALLBACK),
        _resolved(DEFAULT_ITEM_NAME_PATHS, DEFAULT_ITEM_NAME_FALLBACK),
        _resolved(READ_COROUTINE_PATHS, READ_COROUTINE_FALLBACK),
    )


TMP_DIR_SUFFIX, PYTREE_METADATA_FILE, DEFAULT_ITEM_NAME, READ_COROUTINE = _constants()
# What orbax names the temporary directory of step N.
UNFINISHED_STEP = re.compile(rf"(0|[1-9][0-9]*){re.escape(TMP_DIR_SUFFIX)}.*")


def written_parts(array: Any) -> list[tuple[tuple[slice, ...], Any, tuple[slice, ...]]]:
    """The parts of `array` orbax has this process write, each as its index in `array`, the local
    shard's data (a single-device array) holding it, and where in that shard it lies.

    Orbax's registered `jax.Array` handler saves replica-parallel by default (off where
    `JAX_PLATFORMS` names a GPU): each of a shard's R copies writes 1/R of it, split along the
    shard's first dimension that R divides, so in a job of several processes a process also
    writes parts of shards whose `replica_id` is not 0. This asks orbax's own function, with the
    handler's options (private attributes, read with their defaults), which parts those are.
    Where the function cannot be found (an orbax that moved it), each local shard of replica 0
    whole, as orbax saves without replica-parallel.
    """
    import jax
    import orbax.checkpoint as ocp

    handler = ocp.type_handlers.get_type_handler(jax.Array)
    replica_id = getattr(handler, "_replica_id", 0)
    found = lookup(REPLICA_SLICES_PATHS)
    whole = tuple(slice(None) for _ in array.shape)
    if found is None:
        return [
            (s.index, s.data, whole) for s in array.addressable_shards if s.replica_id == (replica_id or 0)
        ]
    parallel = bool(getattr(handler, "_use_replica_parallel", False)) and replica_id is not None
    chosen = found[1](
        array,
        replica_id,
        parallel,
        getattr(handler, "_min_slice_bytes_for_replica_parallel", None),
        getattr(handler, "_max_replicas_for_replica_parallel", None),
    )
    parts = []
    for part in chosen.replica_slices:
        within = whole
        if part.slice_args is not None:
            axis = part.slice_args.axis
            cut = slice(part.slice_args.start_index, part.slice_args.limit_index)
            within = (*whole[:axis], cut, *whole[axis + 1 :])
        parts.append((part.index, part.unsliced_data, within))
    return parts


def logger() -> logging.Logger:
    """The logger orbax reports failed writes through: absl's, a standard `logging.Logger`."""
    return absl_logging.get_absl_logger()


def drop_abandoned_reads(error: BaseException) -> None:
    """Collect the reads orbax abandoned when it raised `error`, without their messages on stderr.

    When orbax cannot read one leaf, it abandons the reads of the others, each of which, once
    garbage collected, prints "Exception ignored in: <coroutine ...>" with a traceback (orbax
    turns the GeneratorExit that closes it into an Exception). They are reachable from the frames
    of `error`'s traceback (and its causes'), which are cleared here: the tracebacks keep their
    lines, not the frames' variables. Reads that tensorstore still holds at that moment (it
    happens, now and then) are collected, and print, later.
    """
    original = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if getattr(unraisable.object, "__qualname__", None) != READ_COROUTINE:
            original(unraisable)

    sys.unraisablehook = hook
    try:
        # Clearing a suspended coroutine's frame closes it: the messages start here already.
        seen = set()
        current: BaseException | None = error
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            if current.__traceback__ is not None:
                traceback.clear_frames(current.__traceback__)
            current = current.__cause__ or current.__context__
        gc.collect()
    finally:
        sys.unraisablehook = original
