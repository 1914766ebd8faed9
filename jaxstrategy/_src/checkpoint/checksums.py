"""The CRC32C of every byte a step holds, and the record that says so: what a save writes.

Orbax stores arrays compressed but unchecked, and the JSON items beside them as plain text. So a
step gets one more item, `checksums`, in which each process writes the CRC32C of each part of a
shard and of each JSON item that it writes, and a record in the step's metadata saying it was
checksummed; `verification.py` checks them on restore. docs/internals.md ("Checksums") says what
is summed, by whom, and why the record lives where it does.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import google_crc32c
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import future as ocp_future

from jaxstrategy._src.checkpoint import regions, stored_leaves
from jaxstrategy._src.checkpoint.format import (
    CHECKSUM_HANDLER_TYPESTR,
    answer_to_former_names,
    process_file,
)
from jaxstrategy._src.core import orbax_compat
from jaxstrategy._src.core.types import PyTree

# Named in the record and in each file, so that a later change of algorithm is recognised
# rather than misread.
ALGORITHM = "crc32c"
# The key of the record in orbax's step `custom_metadata`.
RECORD_KEY = "jaxstrategy_checksums"
# google-crc32c takes `bytes` only (it refuses numpy's buffers), so arrays are summed in copies of
# this size: cached, and large enough that the package releases the GIL while it sums.
_CHUNK_BYTES = 1 << 20
# How every message about damaged checksums ends: what the user can do.
RESTORE_ANOTHER = "Restore another step, or restore with verify=False to read it unchecked."

# Whether saves write checksums. Private: bench/checkpoint.py turns it off to measure their cost.
write_checksums = True

# --- the algorithm -----------------------------------------------------------------------------


def crc32c(data: np.ndarray | bytes) -> int:
    """The CRC32C of `data`: bytes, or an array's bytes in C order.

    Example:
      >>> import numpy as np
      >>> hex(crc32c(b'123456789'))  # The standard check value of CRC-32C.
      '0xe3069283'
      >>> array = np.arange(3, dtype=np.float32)
      >>> crc32c(array) == crc32c(array.tobytes())
      True
    """
    if isinstance(data, bytes):
        return int(google_crc32c.value(data))
    flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    crc = 0
    for start in range(0, flat.nbytes, _CHUNK_BYTES):
        crc = google_crc32c.extend(crc, flat[start : start + _CHUNK_BYTES].tobytes())
    return int(crc)


def canonical_json(value: Any) -> bytes:
    """The content of a JSON value, independent of how it was formatted."""
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


# How restoring checks a region's CRC32C: from the restored bytes of the region, or, where
# processes hold its parts, from each one's sum of its parts (`verification.combine`).
CRC32C_SUMS = regions.RegionSums(crc32c, "crc32c", from_parts=True, described="CRC32C checksums")


# --- saving ------------------------------------------------------------------------------------


def save_args(
    state: PyTree, *, orbax_json: Mapping[str, Any], own_files: Mapping[str, bytes]
) -> ChecksumSave:
    """This process's part of the `checksums` item of a step holding `state` (leaves as orbax
    stores them), the orbax JSON items `orbax_json` (by item name, which process 0 sums) and the
    files `own_files` this process writes itself (by path in the step).

    Device shards are taken in host memory now (on CPU a view of the device buffer, as orbax
    itself takes; elsewhere a copy) and summed in orbax's background commit, so that
    `Checkpointer.save` blocks no longer; host leaves, which the caller may change in place once
    the save returns, are summed now, which costs less than the copy orbax makes of them.
    """
    primary = jax.process_index() == 0
    summed: dict[str, dict[str, int]] = {}
    shards: dict[str, dict[str, Any]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = stored_leaves.path_string(path)
        if isinstance(leaf, jax.Array):
            parts = {
                regions.key(regions.region_of(index, leaf.shape)): (data, within)
                for index, data, within in orbax_compat.written_parts(leaf)
            }
            if parts:
                shards[name] = parts
        elif primary:  # A host array (or numpy scalar): orbax has the primary process write it.
            data = np.asarray(leaf)
            summed[name] = {regions.key(regions.whole(data.shape)): crc32c(data)}
    for parts in shards.values():  # Every device-to-host copy starts before the first is waited for.
        for data, _ in parts.values():
            data.copy_to_host_async()
    # A part of a shard is a view of its host copy (on CPU, of the device buffer itself).
    host = {
        name: {key: np.asarray(data)[within] for key, (data, within) in parts.items()}
        for name, parts in shards.items()
    }
    items = {name: crc32c(data) for name, data in own_files.items()}
    if primary:
        items |= {item: crc32c(canonical_json(value)) for item, value in orbax_json.items()}
    return ChecksumSave(host, summed, items)


def step_record() -> dict[str, Any]:
    """What a checksummed step's `custom_metadata` holds: the algorithm, and how many files."""
    return {RECORD_KEY: {"algorithm": ALGORITHM, "processes": jax.process_count()}}


def _file_content(args: ChecksumSave) -> str:
    leaves = {name: dict(parts) for name, parts in args.summed.items()}
    for name, parts in args.shards.items():
        leaves.setdefault(name, {}).update({key: crc32c(data) for key, data in parts.items()})
    return json.dumps({"algorithm": ALGORITHM, "leaves": leaves, "items": args.items})


# --- the orbax item ----------------------------------------------------------------------------


class ChecksumHandler(ocp.AsyncCheckpointHandler):  # type: ignore[misc]
    """Orbax's handler of the `checksums` item: sums the shards in the background commit, and
    writes this process's file.

    Its `restore` gives every file of the item, by name (what plain orbax gets); jaxstrategy reads
    them with `verification.load`. `metadata`, `finalize` and `close` are orbax's own, which do nothing.
    """

    @classmethod
    def typestr(cls) -> str:
        """How step metadata names this handler: a fixed name, not the module's path (`format.py`)."""
        return CHECKSUM_HANDLER_TYPESTR

    async def async_save(self, directory: Any, args: ChecksumSave) -> list[Any]:
        # Runs in a thread of its own, once orbax has created the item's directory (which it may
        # do in the background, and on process 0 only).
        write = _write_own_file_async(Path(directory), args)
        return [ocp_future.CommitFutureAwaitingContractedSignals(write, name="checksums")]

    def save(self, directory: Any, args: ChecksumSave) -> None:
        _write_own_file(Path(directory), args)

    def restore(self, directory: Any, args: ChecksumRestore | None = None) -> dict[str, Any]:
        del args
        return read_files(Path(directory))


def _write_own_file(directory: Path, args: ChecksumSave) -> None:
    name = process_file(jax.process_index(), jax.process_count())
    (directory / name).write_text(_file_content(args))


async def _write_own_file_async(directory: Path, args: ChecksumSave) -> None:
    _write_own_file(directory, args)


def read_files(directory: Path) -> dict[str, Any]:
    """Each JSON file of the item, parsed, by name.

    Raises:
      ValueError: one is not JSON.
    """
    files = {}
    for path in sorted(directory.glob("*.json")):
        try:
            files[path.name] = json.loads(path.read_text())
        except ValueError as error:
            raise ValueError(
                f"its 'checksums' item's file {path.name} is not JSON ({error}), so it was damaged or "
                f"changed after the save. {RESTORE_ANOTHER}"
            ) from error
    return files


@ocp.args.register_with_handler(ChecksumHandler, for_save=True)
@dataclasses.dataclass
class ChecksumSave(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """This process's shards in host memory and sums taken already, by leaf path and region key,
    and the sums of JSON items by path in the step."""

    shards: dict[str, dict[str, np.ndarray]]
    summed: dict[str, dict[str, int]]
    items: dict[str, int]


@ocp.args.register_with_handler(ChecksumHandler, for_restore=True)
@dataclasses.dataclass
class ChecksumRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]
    pass


# Steps name it by its typestr, which `register_with_handler` registered above; older steps by a
# former name.
answer_to_former_names(ChecksumHandler, ChecksumSave, ChecksumRestore)
