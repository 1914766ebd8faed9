"""Checking a restored step against the checksums saved with it: what restoring refuses, and why.

`load` reads a step's `checksums` item and record (`checksums.py`) and checks that they are whole
before anything else is read; `SavedChecksums` checks the JSON items and says which regions of
each leaf were summed; `mismatches` and `combine` check the restored arrays, whatever sharding and
processes they were restored onto. docs/internals.md ("Checksums") says how.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import jax

from jaxstrategy._src.checkpoint import block_sums, regions, stored_leaves
from jaxstrategy._src.checkpoint.checksums import (
    ALGORITHM,
    CRC32C_SUMS,
    RECORD_KEY,
    RESTORE_ANOTHER,
    canonical_json,
    crc32c,
    read_files,
)
from jaxstrategy._src.checkpoint.format import (
    CHECKSUMS_ITEM,
    ITERATORS_ITEM,
    PRNG_KEYS_ITEM,
    PROCESS_FILE,
    ZERO_SIZE_SHAPES_ITEM,
    process_file,
)
from jaxstrategy._src.core.errors import bullet_list
from jaxstrategy._src.core.types import PyTree

# The older formats' checksums that restoring still checks, as the message about an unknown
# algorithm names them (format 1, `block_sums.py`).
_OLDER_ALGORITHMS = f" (and {block_sums.ALGORITHM!r}, of earlier versions)"


class StepChecksums(Protocol):
    """What restoring asks of a step's saved checksums, whichever format saved them."""

    @property
    def algorithm(self) -> str: ...

    @property
    def sums(self) -> regions.RegionSums: ...

    def files_in(self, item: str) -> dict[str, int] | None:
        """The checksums of the files of `item`, by name; None where the format summed none."""
        ...

    def check_json(self, item: str, value: Any) -> None:
        """Check the content of an orbax JSON item, as read back (a ValueError if it differs)."""
        ...

    def leaf_regions(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[regions.Region, int]]:
        """The saved regions' checksums of each leaf of `shapes` (the step's leaves, as stored)."""
        ...


@dataclasses.dataclass(frozen=True)
class SavedChecksums:
    """The CRC32C checksums saved with a step (format 2), from all of its files.

    Attributes:
      leaves: each leaf path's regions' checksums.
      items: the checksums of the JSON items, by their paths in the step.
    """

    leaves: dict[str, dict[regions.Region, int]]
    items: dict[str, int]
    # Not fields: the same for every step of the format.
    algorithm = ALGORITHM
    sums = CRC32C_SUMS

    def files_in(self, item: str) -> dict[str, int]:
        """The checksums of the files of `item`, by name."""
        prefix = f"{item}/"
        return {name[len(prefix) :]: value for name, value in self.items.items() if name.startswith(prefix)}

    def check_json(self, item: str, value: Any) -> None:
        """Check the content of an orbax JSON item, as read back.

        Raises:
          ValueError: it differs from the content saved.
        """
        found, saved = crc32c(canonical_json(value)), self.items[item]
        if found != saved:
            raise ValueError(
                f"its item {item!r} differs from the one saved (crc32c {found:#010x}, saved "
                f"{saved:#010x}), so its files were damaged or changed after the save. Restore "
                "another step, or restore with verify=False to read it anyway."
            )

    def leaf_regions(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[regions.Region, int]]:
        """The saved regions of each leaf of `shapes` (the step's leaves, as stored), checked to
        cover each one exactly.

        Raises:
          ValueError: a leaf's elements are not all covered, or a checksum is of no leaf.
        """
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
                if regions.intersection(region, regions.whole(shape)) == region
            }
            count = sum(regions.num_elements(region) for region in inside)
            if len(inside) < len(saved) or count != math.prod(shape):
                problems.append(f"{name}: {count} of its {math.prod(shape)} elements have a checksum")
            checked[name] = inside
        if problems:
            raise ValueError(
                "its checksums do not cover all of these leaves, so its 'checksums' item was damaged "
                f"or changed after the save:{bullet_list(problems)}\n{RESTORE_ANOTHER}"
            )
        return checked


def load(step_directory: Path, custom_metadata: Mapping[str, Any] | None) -> StepChecksums | None:
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
        if (directory / block_sums.FILE).is_file():  # Format 1, of jaxstrategy 0.1.
            content = read_files(directory)[block_sums.FILE]
            _check_algorithm(_algorithm_in(content), block_sums.ALGORITHM)
            try:
                return block_sums.from_file(content)
            except (KeyError, TypeError, AttributeError, ValueError) as error:
                raise _not_checksums(block_sums.FILE, error) from error
        raise ValueError(
            f"its 'checksums' item holds {ALGORITHM} checksums, but its _CHECKPOINT_METADATA has no "
            "record of them (every step saved with them has one), so that file was damaged or "
            f"changed after the save. {RESTORE_ANOTHER}"
        )
    if not isinstance(record, Mapping):
        raise ValueError(f"its record of checksums is {record!r}, not a JSON object. {RESTORE_ANOTHER}")
    _check_algorithm(record.get("algorithm"))
    processes = record.get("processes")
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ValueError(
            f"its record of checksums names {processes!r} processes, not a number >= 1. {RESTORE_ANOTHER}"
        )
    names = [process_file(process, processes) for process in range(processes)]
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise ValueError(
            f"it was saved with {ALGORITHM} checksums (its _CHECKPOINT_METADATA says so), but its "
            f"'checksums' item lacks the file {', '.join(missing)}, so its files were damaged or "
            f"changed after the save. {RESTORE_ANOTHER}"
        )
    files = read_files(directory)
    leaves: dict[str, dict[regions.Region, int]] = {}
    items: dict[str, int] = {}
    for name in names:
        content = files[name]
        _check_algorithm(_algorithm_in(content))
        try:
            for path, by_key in content["leaves"].items():
                leaves.setdefault(path, {}).update(
                    {regions.from_key(key): _checksum_in_file(value) for key, value in by_key.items()}
                )
            items |= {str(item): _checksum_in_file(value) for item, value in content["items"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise _not_checksums(name, error) from error
    _check_items(step_directory, items)
    return SavedChecksums(leaves, items)


def _algorithm_in(content: Any) -> Any:
    """The algorithm a file of checksums names; None for one that is not a JSON object."""
    return content.get("algorithm") if isinstance(content, Mapping) else None


def _check_algorithm(algorithm: Any, expected: str = ALGORITHM) -> None:
    if algorithm != expected:
        raise ValueError(
            f"its checksums are of the algorithm {algorithm!r}, and this version of jaxstrategy knows "
            f"only {ALGORITHM!r}{_OLDER_ALGORITHMS}. Upgrade jaxstrategy, or restore with verify=False."
        )


def _not_checksums(name: str, error: Exception) -> ValueError:
    return ValueError(
        f"its 'checksums' item's file {name} is not a file of checksums ({error!r}), so it was "
        f"damaged or changed after the save. {RESTORE_ANOTHER}"
    )


def _checksum_in_file(value: Any) -> int:
    """A checksum as read from a file: an int, not a float or a string that `int()` would take."""
    if type(value) is not int:
        raise ValueError(f"a checksum is {value!r}, not an int")
    return value


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
            f"were damaged or changed after the save. {RESTORE_ANOTHER}"
        )
    if unsummed:
        raise ValueError(
            f"its checksums name no {', '.join(map(repr, unsummed))}, which the step holds, so its "
            f"files were damaged or changed after the save. {RESTORE_ANOTHER}"
        )


def check_file(name: str, data: bytes, saved: Mapping[str, int]) -> None:
    """Check the bytes `data` of the file `name` of an item against its checksums `saved`.

    Raises:
      ValueError: no checksum was saved for it, or its bytes differ.
    """
    if name not in saved:
        raise ValueError(
            f"the file {name} has no checksum, though the step was saved with them, so it was "
            f"added or renamed after the save. {RESTORE_ANOTHER}"
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
      unchecked: the regions no process holds whole whose checksums cannot be put together from
        parts (`RegionSums.from_parts` is false: format 1's).
    """

    damaged: list[str] = dataclasses.field(default_factory=list)
    partial: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)
    unchecked: list[str] = dataclasses.field(default_factory=list)


class _RegionToCheck(NamedTuple):
    """A saved region this process checks, and the restored pieces it reads it from."""

    where: str  # The leaf's path and the region, as messages name it.
    dtype: Any
    region: regions.Region
    saved: int
    pieces: list[tuple[regions.Region, Any]]
    # Whether the pieces are this process's parts of a region split between processes.
    split: bool


def mismatches(
    tree: PyTree,
    saved: Mapping[str, Mapping[regions.Region, int]],
    sums: regions.RegionSums = CRC32C_SUMS,
) -> Findings:
    """Check the leaves of `tree` (as orbax restored them) against their `saved` regions, summed
    as `sums` says.

    A region this process holds whole it checks alone. Of a region split between processes, each
    process holding a part (the lowest of those holding each distinct shard) sums a buffer of the
    region's size holding its parts and zeros elsewhere: CRC32C is affine in the bytes summed, so
    the XOR of those sums, corrected for the zeros, is the region's (`combine`).
    """
    me = jax.process_index()
    to_check = []
    findings = Findings()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = stored_leaves.path_string(path)
        if name not in saved:
            continue
        parts = regions.local_parts(leaf)
        layout = None
        for region, value in saved[name].items():
            where = regions.describe(name, region, leaf.shape)
            held = regions.pieces(region, parts)
            if held is not None:
                to_check.append(_RegionToCheck(where, leaf.dtype, region, value, held, split=False))
                continue
            layout = regions.process_layout(leaf) if layout is None else layout
            owners = None if layout is None else regions.split_parts(layout, region)
            if owners is None:
                continue  # Another process holds it whole, and checks it.
            if not sums.from_parts:
                findings.unchecked.append(where)
                continue
            mine = [(part, parts[part]) for part, owner in owners.items() if owner == me]
            if mine:
                to_check.append(_RegionToCheck(where, leaf.dtype, region, value, mine, split=True))
    for check in to_check:  # Every device-to-host copy starts before the first is waited for.
        for _, data in check.pieces:
            if isinstance(data, jax.Array):
                data.copy_to_host_async()
    for check in to_check:
        if check.split:
            buffer = regions.with_zeros(check.region, check.dtype, check.pieces)
            findings.partial[check.where] = (check.saved, crc32c(buffer), buffer.nbytes)
            continue
        found = sums.checksum(regions.region_values(check.region, check.dtype, check.pieces))
        if found != check.saved:
            findings.damaged.append(f"{check.where}: {sums.label} {found:#010x}, saved {check.saved:#010x}")
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
    for where, sums_of_region in by_region.items():
        (_, value, _, size), processes = sums_of_region[0], [process for process, *_ in sums_of_region]
        found = functools.reduce(operator.xor, (crc for _, _, crc, _ in sums_of_region))
        if len(sums_of_region) % 2 == 0:
            found ^= crc32c(bytes(size))
        if found != value:
            held = ", ".join(map(str, processes))
            damaged.append(
                f"{where}: crc32c {found:#010x}, saved {value:#010x} (split over processes {held})"
            )
    return damaged
