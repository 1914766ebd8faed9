"""CRC32C checksums of every byte a step holds: each array shard and each JSON item.

Orbax stores arrays compressed but unchecked: a flipped byte in a data file decompresses to
different values and restores silently. The JSON items beside them (`prng_keys`,
`zero_size_shapes`, `iterators`) are plain text: one changed digit skips batches on resume. So a
step gets one more item, `checksums`, and restoring compares what it read with it, as TensorFlow
checks a CRC32C of each tensor.

What is summed, and by whom. Each process of a job writes its own file in the item,
`process_<i>-of-<n>.json` (as `iterators.py` writes positions), so that in a job of several
processes no leaf restores unchecked. It holds:

- `leaves`: for each leaf path, the CRC32C of the bytes of each part of a shard that orbax has
  this process write, keyed by the part's region, `start:stop` per dimension (`0:500,0:8`;
  empty for a scalar): every byte of the job's arrays is summed once, by the process that
  writes it, and nothing is assembled on a host. Orbax saves replica-parallel by default (not
  where `JAX_PLATFORMS` names a GPU): each of a shard's R copies writes 1/R of it, so with
  R = 2 replicas of S = 2 devices over two processes each process writes, and sums, half of
  each shard; `orbax_compat.written_parts` asks orbax which parts. The regions of a process's
  file are thus exactly the chunks of its own OCDBT database (`state/ocdbt.process_<i>`).
  Host (numpy) leaves, which orbax has the primary process write, are summed whole by process 0.
- `items`: the CRC32C of each JSON item the process's save writes. Of its iterator positions
  (`iterators/process_<i>-of-<n>.json`), which jaxstrategy writes itself, the exact bytes of the
  file. Orbax's `JsonCheckpointHandler` writes `prng_keys` and `zero_size_shapes` (on process
  0): their formatting is orbax's, never seen by jaxstrategy and free to change in an orbax
  release, so these are summed over their content in canonical form, `json.dumps(value,
  sort_keys=True, separators=(",", ":"))` of the value saved and of the value orbax reads back.
  An edit that keeps the content (whitespace, key order) goes unseen, and changes nothing
  restored; every other one is seen.

Bytes are in native order (little-endian wherever JAX runs). CRC32C (the `google-crc32c`
package's C code, which uses the CPU's CRC instructions) sees every change of up to 32 bits, and
reordered values, where the sums of 4 KiB blocks that jaxstrategy 0.1 used did not (two float32
values swapped at an even distance within a block, or the even-indexed floats of a block
permuted, left every sum the same). Measured on the 2-core development machine over 100 MiB:
7.7 ms for the C library on one buffer, 8.4 ms here, where the package takes only `bytes` and so
gets 1 MiB copies (each stays in cache; from 1 MiB on, the package lets go of the GIL while it
sums, so a background save does not hold up the training loop), against 9.7 ms for a plain copy
and 36 ms for zlib's CRC-32. Two threads were no faster: the sums are bound by memory.

The record. A step saved with checksums says so, and with which algorithm, in orbax's step
metadata: `CheckpointManager.save(custom_metadata=...)` writes `_CHECKPOINT_METADATA` into the
step's temporary directory with the items, so the record commits with the step or not at all, and
orbax reads it back (`manager.metadata(step).custom_metadata`) through its public API. It is not
in `prng_keys`, which every step also has, because that item is a map from leaf paths, any string
of which a tree may use (`{'': x}` has the path ''), and whose readers (older versions, plain
orbax, users' tools) take every entry for a PRNG key leaf's. What the record closes: a missing,
emptied or partial `checksums` item, in a step whose record says it was checksummed, is a
`CorruptCheckpointError`, and so is a `checksums` item of this algorithm without a record (the
record was lost). A step with neither was saved before checksums, and restores unchecked (so
deleting both the item and the record goes unseen, as deleting both would wherever the record
lived); a step of jaxstrategy 0.1 has no record and a `checksums.json` of its whole leaves'
block sums, which are still checked.

Restoring, each process checks every saved region it holds whole in the restored arrays,
whatever sharding they were restored onto: from the one local shard that contains the region (a
slice of it, without a copy when the region is the shard), or else from the local shards that
together cover it, copied into one buffer of the region's size. A region no process holds whole
(restored split over the processes otherwise than saved: saved in halves of rows, restored split
by columns over the devices of both) is checked by the processes holding its parts together,
without reading anything more from storage: CRC32C is affine in the bytes summed, so each sums a
buffer of the region's size holding its parts and zeros elsewhere, and the XOR of their sums,
gathered with the other findings, is the region's once corrected for the zeros (`combine`). Only
jaxstrategy 0.1's checksums, of whole leaves by another algorithm, cannot be put together so: a
leaf of such a step restored split over processes is named in a warning and restores unchecked.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import operator
import zlib
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
    CHECKSUMS_ITEM,
    ITERATORS_ITEM,
    PRNG_KEYS_ITEM,
    PROCESS_FILE,
    ZERO_SIZE_SHAPES_ITEM,
    answer_to_former_names,
    process_file,
)
from jaxstrategy._src.core import orbax_compat
from jaxstrategy._src.core.types import PyTree

# Named in the record and in each file, so that a later change of algorithm is recognised
# rather than misread.
ALGORITHM = "crc32c"
# What jaxstrategy 0.1 wrote, in one file, of the leaves process 0 held whole.
FORMER_ALGORITHM = "crc32 of 4 KiB block sums"
_FORMER_FILE = "checksums.json"
_FORMER_BLOCK_BYTES = 4096
# The key of the record in orbax's step `custom_metadata`.
RECORD_KEY = "jaxstrategy_checksums"
# google-crc32c takes `bytes` only (it refuses numpy's buffers), so arrays are summed in copies of
# this size: cached, and large enough that the package releases the GIL while it sums.
_CHUNK_BYTES = 1 << 20
_REST = "Restore another step, or restore with verify=False to read it unchecked."

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


def _former_checksum(data: np.ndarray) -> int:
    """jaxstrategy 0.1's checksum: a CRC-32 of the length and of each 4 KiB block's sum of words."""
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    whole = data.nbytes - data.nbytes % _FORMER_BLOCK_BYTES
    blocks = data[:whole].view(np.uint64).reshape(-1, _FORMER_BLOCK_BYTES // 8)
    sums = blocks.sum(axis=1, dtype=np.uint64)  # Wraps modulo 2**64, as it did.
    if whole < data.nbytes:  # A last, partial block, padded with zeros.
        tail = np.zeros(_FORMER_BLOCK_BYTES, np.uint8)
        tail[: data.nbytes - whole] = data[whole:]
        sums = np.append(sums, tail.view(np.uint64).sum(dtype=np.uint64))
    crc = zlib.crc32(data.nbytes.to_bytes(8, "little"))
    return zlib.crc32(sums.astype("<u8").data, crc)


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
    them with `load`. `metadata`, `finalize` and `close` are orbax's own, which do nothing.
    """

    @classmethod
    def typestr(cls) -> str:
        """How step metadata names this handler: a fixed name, not the module's path (`format.py`)."""
        return CHECKSUM_HANDLER_TYPESTR

    async def async_save(self, directory: Any, args: ChecksumSave) -> list[Any]:
        # Runs in a thread of its own, once orbax has created the item's directory (which it may
        # do in the background, and on process 0 only).
        write = _write_async(Path(directory), args)
        return [ocp_future.CommitFutureAwaitingContractedSignals(write, name="checksums")]

    def save(self, directory: Any, args: ChecksumSave) -> None:
        _write(Path(directory), args)

    def restore(self, directory: Any, args: ChecksumRestore | None = None) -> dict[str, Any]:
        del args
        return _read_files(Path(directory))


def _write(directory: Path, args: ChecksumSave) -> None:
    name = process_file(jax.process_index(), jax.process_count())
    (directory / name).write_text(_file_content(args))


async def _write_async(directory: Path, args: ChecksumSave) -> None:
    _write(directory, args)


def _read_files(directory: Path) -> dict[str, Any]:
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
                f"changed after the save. {_REST}"
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


# --- restoring ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SavedChecksums:
    """The checksums saved with a step, from all of its files.

    `leaves` maps each path to its regions' checksums; a region of None stands for the whole leaf
    (jaxstrategy 0.1's checksums, whose leaves' shapes the file does not give). `items` maps the
    JSON items' paths in the step to their checksums (none in 0.1's).
    """

    algorithm: str
    leaves: dict[str, dict[regions.Region | None, int]]
    items: dict[str, int]

    def files_in(self, item: str) -> dict[str, int] | None:
        """The checksums of the files of `item`, by name; None for steps that summed no JSON."""
        if self.algorithm != ALGORITHM:
            return None
        prefix = f"{item}/"
        return {name[len(prefix) :]: value for name, value in self.items.items() if name.startswith(prefix)}

    def check_json(self, item: str, value: Any) -> None:
        """Check the content of an orbax JSON item, as read back.

        Raises:
          ValueError: it differs from the content saved.
        """
        if self.algorithm != ALGORITHM:
            return
        found, saved = crc32c(canonical_json(value)), self.items[item]
        if found != saved:
            raise ValueError(
                f"its item {item!r} differs from the one saved (crc32c {found:#010x}, saved "
                f"{saved:#010x}), so its files were damaged or changed after the save. Restore "
                "another step, or restore with verify=False to read it anyway."
            )

    def leaf_regions(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[regions.Region, int]]:
        """The saved regions of each leaf of `shapes` (the step's leaves, as stored), checked to
        cover each one exactly (for the current algorithm; 0.1's skipped some leaves).

        Raises:
          ValueError: a leaf's elements are not all covered, or a checksum is of no leaf.
        """
        if self.algorithm != ALGORITHM:
            return {
                name: {regions.whole(shapes[name]): value for value in saved.values()}
                for name, saved in self.leaves.items()
                if name in shapes
            }
        problems = []
        checked: dict[str, dict[regions.Region, int]] = {}
        for name in sorted(shapes.keys() | self.leaves.keys()):
            if name not in shapes:
                problems.append(f"{name}: has checksums, but the step holds no such leaf")
                continue
            shape, saved = shapes[name], self.leaves.get(name, {})
            inside = {
                region: value
                for region, value in saved.items()
                if region is not None and regions.intersection(region, regions.whole(shape)) == region
            }
            count = sum(regions.num_elements(region) for region in inside)
            if len(inside) < len(saved) or count != math.prod(shape):
                problems.append(f"{name}: {count} of its {math.prod(shape)} elements have a checksum")
            checked[name] = inside
        if problems:
            raise ValueError(
                "its checksums do not cover all of these leaves, so its 'checksums' item was damaged "
                f"or changed after the save:{_lines(problems)}\n{_REST}"
            )
        return checked


def _lines(lines: list[str]) -> str:
    return "".join(f"\n  {line}" for line in lines)


def load(step_directory: Path, custom_metadata: Mapping[str, Any] | None) -> SavedChecksums | None:
    """The checksums of the step in `step_directory`, whose step metadata holds `custom_metadata`;
    None for a step saved before checksums.

    Checks that the item is whole: a file from each process the record names, each of the
    algorithm recorded, and a checksum of each JSON item the step holds, and of no other.

    Raises:
      ValueError: the item or the record is missing, incomplete, or of an unknown algorithm.
    """
    record = (custom_metadata or {}).get(RECORD_KEY)
    directory = step_directory / CHECKSUMS_ITEM
    if record is None:
        if not directory.is_dir():
            return None  # Saved before jaxstrategy wrote checksums.
        if (directory / _FORMER_FILE).is_file():
            return _former(_read_files(directory)[_FORMER_FILE])
        raise ValueError(
            f"its 'checksums' item holds {ALGORITHM} checksums, but its _CHECKPOINT_METADATA has no "
            "record of them (every step saved with them has one), so that file was damaged or "
            f"changed after the save. {_REST}"
        )
    if not isinstance(record, Mapping):
        raise ValueError(f"its record of checksums is {record!r}, not a JSON object. {_REST}")
    _check_algorithm(record.get("algorithm"))
    processes = record.get("processes")
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ValueError(f"its record of checksums names {processes!r} processes, not a number >= 1. {_REST}")
    names = [process_file(process, processes) for process in range(processes)]
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise ValueError(
            f"it was saved with {ALGORITHM} checksums (its _CHECKPOINT_METADATA says so), but its "
            f"'checksums' item lacks the file {', '.join(missing)}, so its files were damaged or "
            f"changed after the save. {_REST}"
        )
    files = _read_files(directory)
    leaves: dict[str, dict[regions.Region | None, int]] = {}
    items: dict[str, int] = {}
    for name in names:
        content = files[name]
        _check_algorithm(content.get("algorithm") if isinstance(content, Mapping) else None)
        try:
            for path, by_key in content["leaves"].items():
                leaves.setdefault(path, {}).update(
                    {regions.from_key(key): _crc(value) for key, value in by_key.items()}
                )
            items |= {str(item): _crc(value) for item, value in content["items"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise _not_checksums(name, error) from error
    _check_items(step_directory, items)
    return SavedChecksums(ALGORITHM, leaves, items)


def _check_algorithm(algorithm: Any) -> None:
    if algorithm != ALGORITHM:
        raise ValueError(
            f"its checksums are of the algorithm {algorithm!r}, and this version of jaxstrategy knows "
            f"only {ALGORITHM!r} (and {FORMER_ALGORITHM!r}, of earlier versions). Upgrade "
            "jaxstrategy, or restore with verify=False."
        )


def _not_checksums(name: str, error: Exception) -> ValueError:
    return ValueError(
        f"its 'checksums' item's file {name} is not a file of checksums ({error!r}), so it was "
        f"damaged or changed after the save. {_REST}"
    )


def _former(content: Any) -> SavedChecksums:
    algorithm = content.get("algorithm") if isinstance(content, Mapping) else None
    if algorithm != FORMER_ALGORITHM:
        _check_algorithm(algorithm)
    try:
        leaves: dict[str, dict[regions.Region | None, int]] = {
            str(path): {None: int(value)} for path, value in content["leaves"].items()
        }
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise _not_checksums(_FORMER_FILE, error) from error
    return SavedChecksums(FORMER_ALGORITHM, leaves, {})


def _check_items(step_directory: Path, items: Mapping[str, int]) -> None:
    """Check that the JSON items summed are the step's, all of them."""
    held = {item for item in (PRNG_KEYS_ITEM, ZERO_SIZE_SHAPES_ITEM) if (step_directory / item).is_dir()}
    positions = step_directory / ITERATORS_ITEM
    if positions.is_dir():
        held |= {
            f"{ITERATORS_ITEM}/{path.name}"
            for path in positions.iterdir()
            if PROCESS_FILE.fullmatch(path.name)
        }
    lacking, unsummed = sorted(items.keys() - held), sorted(held - items.keys())
    if lacking:
        raise ValueError(
            f"its checksums name {', '.join(map(repr, lacking))}, which the step lacks, so its files "
            f"were damaged or changed after the save. {_REST}"
        )
    if unsummed:
        raise ValueError(
            f"its checksums name no {', '.join(map(repr, unsummed))}, which the step holds, so its "
            f"files were damaged or changed after the save. {_REST}"
        )


def check_file(name: str, data: bytes, saved: Mapping[str, int]) -> None:
    """Check the bytes `data` of the file `name` of an item against its checksums `saved`.

    Raises:
      ValueError: no checksum was saved for it, or its bytes differ.
    """
    if name not in saved:
        raise ValueError(
            f"the file {name} has no checksum, though the step was saved with them, so it was "
            f"added or renamed after the save. {_REST}"
        )
    found = crc32c(data)
    if found != saved[name]:
        raise ValueError(
            f"the file {name} differs from the one saved (crc32c {found:#010x}, saved "
            f"{saved[name]:#010x}), so it was damaged or changed after the save. Restore another "
            "step, or restore with verify=False to read it anyway."
        )


# --- checking the restored arrays --------------------------------------------------------------


@dataclasses.dataclass
class Findings:
    """What checking the restored leaves found in one process.

    Attributes:
      damaged: one line per region, of those this process holds whole, whose bytes differ from
        their checksum.
      partial: for each region no process holds whole (by its `regions.describe`), the saved
        checksum, this process's partial checksum of it (its parts, zeros elsewhere) and the
        region's size in bytes; `combine` checks them once every process's are gathered.
      unchecked: the regions no process holds whole of a step of jaxstrategy 0.1, whose
        checksums cannot be put together from parts.
    """

    damaged: list[str] = dataclasses.field(default_factory=list)
    partial: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    unchecked: list[str] = dataclasses.field(default_factory=list)


def mismatches(
    tree: PyTree, saved: Mapping[str, Mapping[regions.Region, int]], algorithm: str = ALGORITHM
) -> Findings:
    """Check the leaves of `tree` (as orbax restored them) against their `saved` regions.

    A region this process holds whole it checks alone. Of a region split between processes, each
    process holding a part (the lowest of those holding each distinct shard) sums a buffer of the
    region's size holding its parts and zeros elsewhere: CRC32C is affine in the bytes summed, so
    the XOR of those sums, corrected for the zeros, is the region's (`combine`).
    """
    checksum = crc32c if algorithm == ALGORITHM else _former_checksum
    label = "crc32c" if algorithm == ALGORITHM else "checksum"
    me = jax.process_index()
    plans = []
    findings = Findings()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = stored_leaves.path_string(path)
        if name not in saved:
            continue
        parts = regions.local_parts(leaf)
        layout = None
        for region, value in saved[name].items():
            held = regions.pieces(region, parts)
            if held is not None:
                plans.append((name, leaf.shape, leaf.dtype, region, value, held, False))
                continue
            layout = regions.process_layout(leaf) if layout is None else layout
            owners = None if layout is None else regions.split_parts(layout, region)
            if owners is None:
                continue  # Another process holds it whole, and checks it.
            if algorithm != ALGORITHM:
                findings.unchecked.append(regions.describe(name, region, leaf.shape))
                continue
            mine = [(part, parts[part]) for part, owner in owners.items() if owner == me]
            if mine:
                plans.append((name, leaf.shape, leaf.dtype, region, value, mine, True))
    for *_, held, _ in plans:  # Every device-to-host copy starts before the first is waited for.
        for _, data in held:
            if isinstance(data, jax.Array):
                data.copy_to_host_async()
    for name, shape, dtype, region, value, held, split in plans:
        where = regions.describe(name, region, shape)
        if split:
            buffer = regions.with_zeros(region, dtype, held)
            findings.partial[where] = (value, crc32c(buffer), buffer.nbytes)
            continue
        found = checksum(regions.values(region, dtype, held))
        if found != value:
            findings.damaged.append(f"{where}: {label} {found:#010x}, saved {value:#010x}")
    return findings


def combine(partial: Mapping[int, Mapping[str, tuple[int, int, int]]]) -> list[str]:
    """Check the regions split between processes from every process's partial checksums of them
    (`Findings.partial`, by process index): one line per region whose bytes differ.

    For buffers of one length, crc32c(a ^ b) == crc32c(a) ^ crc32c(b) ^ crc32c(zeros): the parts
    partition the region, so the XOR of the k buffers is the region, and its checksum the XOR of
    their sums, with crc32c(zeros) once more where k is even.
    """
    by_region: dict[str, list[tuple[int, int, int, int]]] = {}
    for process, sums_of_process in sorted(partial.items()):
        for where, (value, crc, size) in sums_of_process.items():
            by_region.setdefault(where, []).append((process, value, crc, size))
    damaged = []
    for where, sums in by_region.items():
        (_, value, _, size), processes = sums[0], [process for process, *_ in sums]
        found = functools.reduce(operator.xor, (crc for _, _, crc, _ in sums))
        if len(sums) % 2 == 0:
            found ^= crc32c(bytes(size))
        if found != value:
            held = ", ".join(map(str, processes))
            damaged.append(
                f"{where}: crc32c {found:#010x}, saved {value:#010x} (split over processes {held})"
            )
    return damaged


def _crc(value: Any) -> int:
    """A checksum as read from a file: an int, not a float or a string that `int()` would take."""
    if type(value) is not int:
        raise ValueError(f"a checksum is {value!r}, not an int")
    return value
