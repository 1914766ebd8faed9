"""Format 1, the block sums of jaxstrategy 0.1: its steps are still checked with them, and what
they could not see is why format 2 sums with CRC32C."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from checkpoint_support import damaged_bytes, iterator_after, transplant_state
from test_format import FIXTURE, _saved_arrays

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import block_sums


@pytest.fixture
def saved_before(tmp_path: Path) -> Path:
    """A copy of the fixture of jaxstrategy 0.1 (step 7), since restoring may write beside it."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "checkpoint"))


def test_a_checkpoint_of_the_former_algorithm_is_still_verified(saved_before):
    # The fixture's checksums are the sums of 4 KiB blocks, and still read as such.
    arrays = _saved_arrays()
    arrays["params"]["dense"]["kernel"] = arrays["params"]["dense"]["kernel"].at[1, 2].add(1.0)
    transplant_state(
        saved_before, {**arrays, "data": iterator_after(jaxstrategy.OneDeviceStrategy(), 0)}, step=7
    )
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=damaged_bytes(re.escape("params/dense/kernel"), saved_before, step=7, label="checksum"),
    ):
        checkpoint.restore(saved_before)


def test_block_sums_of_an_unknown_algorithm_are_a_clear_error(saved_before):
    edited = saved_before / "7" / "checksums" / "checksums.json"
    edited.write_text(edited.read_text().replace('"crc32', '"sha3'))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=rf"(?s)step 7 in {re.escape(str(saved_before))}: .*algorithm 'sha3 of 4 KiB block sums'.*"
        r"knows only 'crc32c' \(and 'crc32 of 4 KiB block sums', of earlier versions\).*Upgrade jaxstrategy",
    ):
        checkpoint.restore(saved_before)
    assert checkpoint.restore(saved_before, verify=False)


def test_block_sums_see_a_changed_value_but_not_reordered_ones():
    values = np.random.default_rng(2).standard_normal(4096, dtype=np.float32)
    changed = values.copy()
    changed[100] = np.nextafter(changed[100], np.inf)
    assert block_sums.block_checksum(changed) != block_sums.block_checksum(values)
    # Two floats at an even distance are the same half of two 64-bit words: swapped, the words'
    # sum stays. So do the even-indexed floats of a block, permuted.
    swapped, permuted = values.copy(), values.copy()
    swapped[[10, 14]] = swapped[[14, 10]]
    permuted[1024:2048:2] = np.random.default_rng(4).permutation(permuted[1024:2048:2])
    assert block_sums.block_checksum(swapped) == block_sums.block_checksum(values)
    assert block_sums.block_checksum(permuted) == block_sums.block_checksum(values)
