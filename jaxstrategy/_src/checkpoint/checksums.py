"""Per-leaf checksums of a checkpoint's arrays: written with each step, checked on restore.

Orbax stores arrays compressed but unchecked: a flipped byte in a data file decompresses to
different values and restores silently. So each step gets one more item, `checksums`: a JSON map
from each leaf's path to a checksum of the bytes orbax was given, and restoring compares the
bytes it got back.

The checksum of a leaf is, over its bytes in native (little-endian) order, the sum modulo 2**64
of each 4 KiB block's 64-bit words, then zlib's CRC-32 of the leaf's length and those sums.
Chosen for speed, measured on the 2-core development machine over 100 MiB: numpy sums the
blocks at 12 GiB/s per core (8 ms), against 2.1 GiB/s for `zlib.crc32` (46 ms), 1.9 for
`zlib.adler32` and 1.0 for `hashlib.blake2b`; with CRC-32 over the bytes, saves took 1.45x as
long and restores 1.12x (bench/checkpoint.py). What it sees: any change within one 8-byte word
(so every flipped byte), any change confined to a block unless its words' changes sum to 0
modulo 2**64 (for 64 bytes overwritten at random, once in 2**64), and blocks moved or swapped
(the CRC-32 of the sums). What it misses and CRC-32 would not: words reordered within a block,
and two flips of the same bit in opposite directions within one block. More threads did not
make the sums faster (they are bound by memory), so one does them.

Where the bytes come from:
- saving: the leaves are taken in host memory before the save call returns (on CPU a view of
  the device buffer, as orbax itself takes; elsewhere a copy), and summed in orbax's background
  commit, beside its own writes, so `Checkpointer.save` blocks no longer;
- restoring: from the restored arrays, which every jaxstrategy strategy holds whole on each of
  its devices; on CPU a view, elsewhere a copy of one device's.

A leaf this process does not hold whole (one sharded over the processes of a job) gets no
checksum, and restores unchecked. In a job of several processes the primary one (0), which
writes orbax's own JSON items, writes this one.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from collections.abc import Container, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import future as ocp_future

from jaxstrategy._src.checkpoint import stored_leaves
from jaxstrategy._src.checkpoint.format import (
    CHECKSUM_HANDLER_TYPESTR,
    answer_to_former_names,
)
from jaxstrategy._src.core.types import PyTree

# Named in the file, so that a later change of algorithm is recognised rather than misread.
ALGORITHM = "crc32 of 4 KiB block sums"
_BLOCK_BYTES = 4096
_FILE = "checksums.json"

# Whether saves write checksums. Private: bench/checkpoint.py turns it off to measure their cost.
write_checksums = True


def tree_bytes(tree: PyTree, only: Container[str] | None = None) -> dict[str, np.ndarray]:
    """Each leaf of `tree` that this process holds whole, in host memory as flat bytes, by path.

    Only the paths in `only`, when given. Every device-to-host copy is started before the first
    is waited for.
    """
    wholes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = stored_leaves.path_string(path)
        if only is not None and name not in only:
            continue
        whole = _whole(leaf)
        if whole is not None:
            wholes[name] = whole
    for whole in wholes.values():
        if isinstance(whole, jax.Array):
            whole.copy_to_host_async()
    return {path: np.asarray(whole).reshape(-1).view(np.uint8) for path, whole in wholes.items()}


def _whole(leaf: Any) -> jax.Array | np.ndarray | None:
    """The whole of `leaf` on one device, or in host memory; None where this process lacks a part.

    A replicated array's first device holds it whole, so only that copy is read (on CPU, JAX
    hands out a view of its buffer; elsewhere, a copy that it keeps with the array, as it does
    for orbax's own save). Only an array sharded over this process's devices is assembled.
    """
    if isinstance(leaf, np.ndarray):
        # A copy, as orbax makes of host arrays: the caller may change the array in place while a
        # background save still reads it.
        return np.array(leaf, order="C")
    if not isinstance(leaf, jax.Array):
        return None
    shards = leaf.addressable_shards
    whole = next((shard.data for shard in shards if shard.data.shape == leaf.shape), None)
    if whole is not None or not leaf.is_fully_addressable:
        return whole  # None: sharded over processes, so no process holds it all.
    # Sharded over this process's devices: assembled, one copy of each part.
    assembled = np.empty(leaf.shape, leaf.dtype)
    for shard in shards:
        if shard.replica_id == 0:
            assembled[shard.index] = np.asarray(shard.data)
    return assembled


def checksums(leaves: Mapping[str, np.ndarray]) -> dict[str, int]:
    """The checksum of each of `leaves` (flat byte arrays), by path.

    Example:
      >>> import numpy as np
      >>> data = np.arange(3, dtype=np.float32).view(np.uint8)
      >>> checksums({'w': data})
      {'w': 2660201890}
      >>> data[0] ^= 1
      >>> checksums({'w': data})
      {'w': 1378186556}
    """
    return {path: _checksum(data) for path, data in leaves.items()}


def _checksum(data: np.ndarray) -> int:
    whole = data.nbytes - data.nbytes % _BLOCK_BYTES
    blocks = data[:whole].view(np.uint64).reshape(-1, _BLOCK_BYTES // 8)
    sums = blocks.sum(axis=1, dtype=np.uint64)  # Wraps modulo 2**64, as wanted.
    if whole < data.nbytes:  # A last, partial block, padded with zeros.
        tail = np.zeros(_BLOCK_BYTES, np.uint8)
        tail[: data.nbytes - whole] = data[whole:]
        sums = np.append(sums, tail.view(np.uint64).sum(dtype=np.uint64))
    crc = zlib.crc32(data.nbytes.to_bytes(8, "little"))
    return zlib.crc32(sums.astype("<u8").data, crc)


def mismatches(tree: PyTree, saved: Mapping[str, int]) -> list[str]:
    """One line per leaf of `tree` (as orbax restored it) whose bytes differ from their checksum.

    Leaves without a saved checksum, or not held whole by this process, are not checked.
    """
    found = checksums(tree_bytes(tree, only=saved))
    return [
        f"{path}: checksum {found[path]:#010x}, saved {saved[path]:#010x}"
        for path in sorted(found)
        if found[path] != saved[path]
    ]


def read(record: Mapping[str, Any]) -> dict[str, int]:
    """The checksums by path from a restored `checksums` item.

    Raises:
      ValueError: the record was written with another algorithm, by a later jaxstrategy.
    """
    if record.get("algorithm") != ALGORITHM:
        raise ValueError(
            f"its checksums are of the algorithm {record.get('algorithm')!r}, and this version of "
            f"jaxstrategy knows only {ALGORITHM!r}. Upgrade jaxstrategy, or restore with verify=False."
        )
    return {str(path): int(value) for path, value in record["leaves"].items()}


# --- the orbax item ----------------------------------------------------------------------------


class ChecksumHandler(ocp.AsyncCheckpointHandler):  # type: ignore[misc]
    """Orbax's handler of the `checksums` item: sums the leaves in the background commit.

    `metadata`, `finalize` and `close` are orbax's own, which do nothing.
    """

    @classmethod
    def typestr(cls) -> str:
        """How step metadata names this handler: a fixed name, not the module's path (`format.py`)."""
        return CHECKSUM_HANDLER_TYPESTR

    async def async_save(self, directory: Any, args: ChecksumSave) -> list[Any]:
        if not args.primary:
            return []
        # Runs in a thread of its own, once orbax has created the item's directory (which it may
        # do in the background).
        write = _write_async(Path(directory), args.leaves)
        return [ocp_future.CommitFutureAwaitingContractedSignals(write, name="checksums")]

    @staticmethod
    def _write(directory: Path, leaves: dict[str, np.ndarray]) -> None:
        record = {"algorithm": ALGORITHM, "leaves": checksums(leaves)}
        (directory / _FILE).write_text(json.dumps(record))

    def save(self, directory: Any, args: ChecksumSave) -> None:
        if args.primary:
            self._write(Path(directory), args.leaves)

    def restore(self, directory: Any, args: ChecksumRestore | None = None) -> dict[str, Any]:
        del args
        record: dict[str, Any] = json.loads((Path(directory) / _FILE).read_text())
        return record


async def _write_async(directory: Path, leaves: dict[str, np.ndarray]) -> None:
    ChecksumHandler._write(directory, leaves)


@ocp.args.register_with_handler(ChecksumHandler, for_save=True)
@dataclasses.dataclass
class ChecksumSave(ocp.args.CheckpointArgs):  # type: ignore[misc]
    """The leaves' bytes, taken when the save starts, and whether this process writes the item."""

    leaves: dict[str, np.ndarray]
    primary: bool


@ocp.args.register_with_handler(ChecksumHandler, for_restore=True)
@dataclasses.dataclass
class ChecksumRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]
    pass


# Steps name it by its typestr, which `register_with_handler` registered above; older steps by a
# former name.
answer_to_former_names(ChecksumHandler, ChecksumSave, ChecksumRestore)


def save_args(state: PyTree) -> ChecksumSave:
    """The item for a step holding `state` (leaves as orbax stores them), its bytes taken now.

    Only the primary process, which writes the item, takes them.
    """
    primary = jax.process_index() == 0
    return ChecksumSave(tree_bytes(state) if primary else {}, primary)
