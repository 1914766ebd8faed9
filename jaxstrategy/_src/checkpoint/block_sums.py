"""Checkpoint format 1: the checksums of jaxstrategy 0.1, a CRC-32 of each whole leaf's block sums.

A step saved by jaxstrategy 0.1 holds one file of checksums, `checksums/checksums.json`, of the
leaves process 0 held whole, and no record in its step metadata. Restoring still checks such
steps with them. All of this format lives here: to stop reading it, delete this module and its
import and dispatch in `verification.py`.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from jaxstrategy._src.checkpoint import regions

# The algorithm the file names, and the file's name in the `checksums` item.
ALGORITHM = "crc32 of 4 KiB block sums"
FILE = "checksums.json"
_BLOCK_BYTES = 4096


def block_checksum(data: np.ndarray) -> int:
    """jaxstrategy 0.1's checksum of `data`: a CRC-32 of its length and of each 4 KiB block's sum
    of 64-bit words.

    Example:
      >>> import numpy as np
      >>> values = np.arange(8, dtype=np.float32)
      >>> swapped = values[[2, 1, 0, 3, 4, 5, 6, 7]]  # Two floats an even distance apart.
      >>> block_checksum(values) == block_checksum(swapped)  # Why format 2 uses CRC32C.
      True
    """
    data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    whole = data.nbytes - data.nbytes % _BLOCK_BYTES
    blocks = data[:whole].view(np.uint64).reshape(-1, _BLOCK_BYTES // 8)
    block_totals = blocks.sum(axis=1, dtype=np.uint64)  # Wraps modulo 2**64, as it did.
    if whole < data.nbytes:  # A last, partial block, padded with zeros.
        tail = np.zeros(_BLOCK_BYTES, np.uint8)
        tail[: data.nbytes - whole] = data[whole:]
        block_totals = np.append(block_totals, tail.view(np.uint64).sum(dtype=np.uint64))
    crc = zlib.crc32(data.nbytes.to_bytes(8, "little"))
    return zlib.crc32(block_totals.astype("<u8").data, crc)


# Sums of whole leaves by another algorithm cannot be put together from the parts of a leaf that
# several processes hold: such a leaf restores unchecked, with a warning.
SUMS = regions.RegionSums(
    block_checksum, "checksum", from_parts=False, described="the checksums of jaxstrategy 0.1"
)


@dataclasses.dataclass(frozen=True)
class SavedBlockSums:
    """The checksums of a step of jaxstrategy 0.1: one of each whole leaf process 0 held, by path.

    It answers restoring's questions as `verification.SavedChecksums` does; 0.1 summed no JSON
    items, so those go unchecked.
    """

    leaves: dict[str, int]
    # Not fields: the same for every step of the format.
    algorithm = ALGORITHM
    sums = SUMS

    def files_in(self, item: str) -> None:
        """None: jaxstrategy 0.1 summed no files of items."""
        del item

    def check_json(self, item: str, value: Any) -> None:
        """Nothing to check: jaxstrategy 0.1 summed no JSON items."""
        del item, value

    def leaf_regions(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, dict[regions.Region, int]]:
        """Each summed leaf of `shapes` (the step's leaves, as stored) as one region, the whole
        leaf; the leaves 0.1 did not sum (those process 0 did not hold whole) have none."""
        summed = self.leaves.items()
        return {name: {regions.whole(shapes[name]): value} for name, value in summed if name in shapes}


def from_file(content: Any) -> SavedBlockSums:
    """The block sums in `content`, the parsed `checksums.json` of a step of jaxstrategy 0.1.

    Raises:
      KeyError, TypeError, AttributeError, ValueError: `content` is not such a file.
    """
    return SavedBlockSums({str(path): int(value) for path, value in content["leaves"].items()})
