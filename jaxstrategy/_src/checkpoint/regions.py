"""Which part of a leaf a checksum is of, and where a process finds that part's bytes.

A region is a box of a leaf, `(start, stop)` per dimension: the part one shard holds, as JAX's
`shard.index` gives it. A saved shard's region is checked, once restored, from the local shards
of whatever sharding it was restored onto: a slice of the one that contains it (a view, and the
whole shard when the layouts match), or else one buffer of the region's size filled from the
local shards that cover it; a region no local shard set covers is another process's to check.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import numpy as np

Region = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class RegionSums:
    """How a checkpoint format sums the bytes of a region, as restoring checks them.

    Attributes:
      checksum: the checksum of a region's values (a host array, in C order).
      label: how a message names one such checksum, as in `w: crc32c 0x1234abcd, saved ...`.
      from_parts: whether a region split between processes can be checked from each process's
        sum of its parts with zeros elsewhere (CRC32C can: it is affine in the bytes summed).
      described: what a warning calls these checksums.
    """

    checksum: Callable[[np.ndarray], int]
    label: str
    from_parts: bool
    described: str


def region_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Region:
    """The region a shard's `index` (JAX's slices, steps of 1) covers in a leaf of `shape`."""
    return tuple(
        (0 if part.start is None else int(part.start), length if part.stop is None else int(part.stop))
        for part, length in zip(index, shape, strict=True)
    )


def whole(shape: tuple[int, ...]) -> Region:
    """The region of a whole leaf of `shape`."""
    return tuple((0, length) for length in shape)


def key(region: Region) -> str:
    """How a checksum file names a region: `start:stop` per dimension, joined by ',' ('' for a scalar).

    Example:
      >>> key(((0, 500), (0, 8))), from_key('0:500,0:8')
      ('0:500,0:8', ((0, 500), (0, 8)))
    """
    return ",".join(f"{start}:{stop}" for start, stop in region)


def from_key(text: str) -> Region:
    """The region a checksum file names by `text`.

    Raises:
      ValueError: `text` is not of the form `key` writes.
    """
    if not text:
        return ()
    bounds = [part.split(":") for part in text.split(",")]
    if any(len(pair) != 2 for pair in bounds):
        raise ValueError(f"{text!r} is not a region, such as '0:500,0:8'")
    return tuple((int(start), int(stop)) for start, stop in bounds)


def describe(path: str, region: Region, shape: tuple[int, ...]) -> str:
    """The leaf's path, and the region when it is not the whole leaf: `w[500:1000, 0:8]`."""
    if region == whole(shape):
        return path
    return f"{path}[{', '.join(f'{start}:{stop}' for start, stop in region)}]"


def num_elements(region: Region) -> int:
    return math.prod(stop - start for start, stop in region)


def intersection(a: Region, b: Region) -> Region | None:
    """The region `a` and `b` share; None when they share no element."""
    both = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return both if all(start < stop for start, stop in both) else None


def covered(region: Region, parts: Iterable[Region]) -> bool:
    """Whether `parts` (shard regions of one sharding, which do not overlap unless equal) cover `region`."""
    found = 0
    for part in set(parts):
        both = intersection(region, part)
        if both is not None:
            found += num_elements(both)
    return found == num_elements(region)


def local_parts(leaf: Any) -> dict[Region, Any]:
    """The distinct regions of `leaf` this process holds, each with one local shard's data (a
    single-device jax.Array), or the whole of a host array."""
    if not isinstance(leaf, jax.Array):
        host = np.asarray(leaf)
        return {whole(host.shape): host}
    parts: dict[Region, Any] = {}
    for shard in leaf.addressable_shards:
        parts.setdefault(region_of(shard.index, leaf.shape), shard.data)
    return parts


def pieces(region: Region, parts: dict[Region, Any]) -> list[tuple[Region, Any]] | None:
    """The `parts` (from `local_parts`) to read `region` from; None when they do not hold all of it.

    One part when one contains the region; else every part that holds some of it.
    """
    touching = [(part, data) for part, data in parts.items() if intersection(region, part) is not None]
    for part, data in touching:
        if intersection(region, part) == region:
            return [(part, data)]
    return touching if covered(region, (part for part, _ in touching)) else None


def region_values(region: Region, dtype: Any, held: list[tuple[Region, Any]]) -> np.ndarray:
    """The values of `region` in host memory, from the pieces `held` that `pieces` chose.

    From one piece, a view of it (the piece itself when it is the region); from several, one
    buffer of the region's size, assembled.
    """
    if len(held) == 1:
        ((part, data),) = held
        host = np.asarray(data)
        return host if region == part else host[_slices(region, part)]
    return _assembled(np.empty([stop - start for start, stop in region], dtype), region, held)


def _assembled(buffer: np.ndarray, region: Region, held: list[tuple[Region, Any]]) -> np.ndarray:
    """`buffer`, of `region`'s size, with the values of the pieces `held` copied where they are."""
    for part, data in held:
        both = intersection(region, part)
        assert both is not None, "only parts that hold some of the region are held"
        buffer[_slices(both, region)] = np.asarray(data)[_slices(both, part)]
    return buffer


def _slices(region: Region, within: Region) -> tuple[slice, ...]:
    """`region` as slices of an array holding the region `within`."""
    return tuple(
        slice(start - offset, stop - offset)
        for (start, stop), (offset, _) in zip(region, within, strict=True)
    )


def process_layout(leaf: Any) -> dict[int, list[Region]] | None:
    """The regions of the shards of `leaf` each process holds, by process index; None for a leaf
    this process holds all of (a host array, or a fully addressable `jax.Array`)."""
    if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
        return None
    indices: Mapping[jax.Device, tuple[slice, ...]] = leaf.sharding.devices_indices_map(leaf.shape)
    layout: dict[int, list[Region]] = {}
    for device, index in indices.items():
        layout.setdefault(device.process_index, []).append(region_of(index, leaf.shape))
    return layout


def split_parts(layout: Mapping[int, list[Region]], region: Region) -> dict[Region, int] | None:
    """Who holds which part of `region`, by a leaf's `process_layout`, where no process holds it
    whole: the distinct shard regions that hold some of it, each with the lowest process holding
    it; None when some process holds `region` whole (that process checks it).

    Every process gets the same answer, from the leaf's global sharding.
    """
    if any(covered(region, parts) for parts in layout.values()):
        return None
    owners: dict[Region, int] = {}
    for process, parts in sorted(layout.items()):
        for part in parts:
            if intersection(region, part) is not None:
                owners.setdefault(part, process)
    return owners


def with_zeros(region: Region, dtype: Any, held: list[tuple[Region, Any]]) -> np.ndarray:
    """A buffer of `region`'s size holding the values of the pieces `held` where they are, and zero
    bytes elsewhere."""
    return _assembled(np.zeros([stop - start for start, stop in region], dtype), region, held)
