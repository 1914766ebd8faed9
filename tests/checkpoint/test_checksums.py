"""Checksums: damaged bytes are a CorruptCheckpointError naming the leaf; unchecked steps still restore."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_support import assert_bit_exact, every_kind_of_leaf, largest_file, zero_size_tree

from jaxstrategy import checkpoint

# --- checksums ---------------------------------------------------------------------------------


def _flip(path: Path, start: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[start : start + count] = bytes(byte ^ 0xFF for byte in data[start : start + count])
    path.write_bytes(bytes(data))


def _save_damaged(directory: Path, leaf, fraction: float, count: int) -> np.ndarray:
    """Save {'w': leaf, 'b': {'c': ...}}, flip `count` bytes of the array data file at `fraction`
    of its length, and return w's values as saved."""
    checkpoint.save(directory, {"w": leaf, "b": {"c": jnp.ones(5)}})
    data = largest_file(directory / "0" / "state")  # w's compressed chunk, in orbax's OCDBT store
    _flip(data, int(data.stat().st_size * fraction), count)
    return np.asarray(leaf)


_DAMAGED = r"the bytes read for these leaves differ from those saved \(their checksums, written with the step, do not match\), so its files were damaged or changed after the save:\n  w: checksum 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}\nRestore another step, or restore with verify=False"


@pytest.mark.parametrize("count", [1, 64], ids=["1-byte", "64-bytes"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_flipped_bytes_in_the_array_data_are_a_corrupt_checkpoint_naming_the_leaf(tmp_path, fraction, count):
    values = jnp.asarray(np.random.default_rng(0).standard_normal(100_000, dtype=np.float32))
    saved = _save_damaged(tmp_path, values, fraction, count)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=re.escape(f"Cannot read the checkpoint at step 0 in {tmp_path}: ") + _DAMAGED,
    ):
        checkpoint.restore(tmp_path)
    damaged = checkpoint.restore(tmp_path, verify=False)["w"]
    assert not np.array_equal(np.asarray(damaged), saved), "the flip landed in w's values"


def test_damage_that_orbax_cannot_decompress_is_a_corrupt_checkpoint_naming_the_leaf(tmp_path):
    values = jnp.asarray(np.random.default_rng(0).standard_normal(100_000, dtype=np.float32))
    # One leaf: orbax abandons the reads of the others when one fails, and those print
    # "Exception ignored" at a time of the garbage collector's choosing, which pytest reports.
    checkpoint.save(tmp_path, {"w": values})
    _flip(largest_file(tmp_path / "0" / "state"), 5, 1)  # In the header of w's zstd frame.
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=re.escape(
            f"Cannot read the checkpoint at step 0 in {tmp_path}: the data of the leaf 'w' cannot be "
            "read, so its files were damaged or changed after the save ("
        )
        + r".*ZSTD.*\)\. Restore another step\.$",
    ):
        checkpoint.restore(tmp_path)


def test_a_leaf_sharded_over_devices_is_checked_too(tmp_path, cpu_devices):
    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.random.default_rng(1).standard_normal(100_000, dtype=np.float32)
    checkpoint.save(tmp_path / "whole", {"w": jax.device_put(values, sharding)})
    assert np.array_equal(np.asarray(checkpoint.restore(tmp_path / "whole")["w"]), values)
    _save_damaged(tmp_path / "damaged", jax.device_put(values, sharding), 0.5, 64)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_DAMAGED):
        checkpoint.restore(tmp_path / "damaged")


def test_every_kind_of_leaf_restores_through_its_checksum(tmp_path):
    tree = {
        **every_kind_of_leaf(),
        "empty": zero_size_tree(),
        "i64": np.array([-(2**31)], np.int64),
    }
    checkpoint.save(tmp_path, tree)
    record = (tmp_path / "0" / "checksums" / "checksums.json").read_text()
    assert all(f'"{name}' in record for name in ("f32", "bf16/0", "keys/1", "empty/rows", "i64"))
    restored = checkpoint.restore(tmp_path, target={**tree, "i64": np.zeros(1, np.int64)})
    assert_bit_exact({key: restored[key] for key in every_kind_of_leaf()}, every_kind_of_leaf())


def test_a_step_saved_without_checksums_restores_unchecked(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    shutil.rmtree(tmp_path / "0" / "checksums")  # As saved before jaxstrategy wrote them.
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0]


def test_checksums_of_an_unknown_algorithm_are_a_clear_error(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    record = tmp_path / "0" / "checksums" / "checksums.json"
    record.write_text(record.read_text().replace("crc32", "sha3"))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=r"its checksums are of the algorithm 'sha3 of 4 KiB block sums', and this version of "
        r"jaxstrategy knows only 'crc32 of 4 KiB block sums'. Upgrade jaxstrategy, or restore with verify=False",
    ):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)["w"].tolist() == [0.0, 1.0, 2.0]


# --- one writer per directory ------------------------------------------------------------------
