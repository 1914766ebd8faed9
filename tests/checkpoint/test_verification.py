"""Restoring checks every byte against the checksums saved with the step: damage, or an edit, is a
CorruptCheckpointError naming the step and the leaf or item; steps saved before checksums restore
unchecked."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_support import (
    HEX,
    damaged_bytes,
    edit_json,
    flip_bytes,
    iterator_after,
    largest_file,
    transplant_state,
)

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import checksums, regions, verification


def _at_step(directory: Path, step: int = 0) -> str:
    """The pattern of a message's start: the step and its directory, as every message names them."""
    return rf"(?s)step {step} in {re.escape(str(directory))}: "


def _save_damaged(directory: Path, leaf, fraction: float, count: int) -> np.ndarray:
    """Save {'w': leaf, 'b': {'c': ...}}, flip `count` bytes of the array data file at `fraction`
    of its length, and return w's values as saved."""
    checkpoint.save(directory, {"w": leaf, "b": {"c": jnp.ones(5)}})
    data = largest_file(directory / "0" / "state")  # w's compressed chunk, in orbax's OCDBT store
    flip_bytes(data, int(data.stat().st_size * fraction), count)
    return np.asarray(leaf)


@pytest.mark.parametrize("count", [1, 64], ids=["1-byte", "64-bytes"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_flipped_bytes_in_the_array_data_are_a_corrupt_checkpoint_naming_the_leaf(tmp_path, fraction, count):
    values = jnp.asarray(np.random.default_rng(0).standard_normal(100_000, dtype=np.float32))
    saved = _save_damaged(tmp_path, values, fraction, count)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=damaged_bytes("w", tmp_path)):
        checkpoint.restore(tmp_path)
    damaged = checkpoint.restore(tmp_path, verify=False)["w"]
    assert not np.array_equal(np.asarray(damaged), saved), "the flip landed in w's values"


def test_damage_that_orbax_cannot_decompress_is_a_corrupt_checkpoint_naming_the_leaf(tmp_path):
    values = jnp.asarray(np.random.default_rng(0).standard_normal(100_000, dtype=np.float32))
    # One leaf: orbax abandons the reads of the others when one fails, and those print
    # "Exception ignored" at a time of the garbage collector's choosing, which pytest reports.
    checkpoint.save(tmp_path, {"w": values})
    flip_bytes(largest_file(tmp_path / "0" / "state"), 5, 1)  # In the header of w's zstd frame.
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + r"the data of the leaf 'w' cannot be read.*ZSTD.*\. Restore another step\.$",
    ):
        checkpoint.restore(tmp_path)


def test_a_leaf_sharded_over_devices_is_checked_too(tmp_path, cpu_devices):
    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.random.default_rng(1).standard_normal(100_000, dtype=np.float32)
    checkpoint.save(tmp_path / "whole", {"w": jax.device_put(values, sharding)})
    assert np.array_equal(np.asarray(checkpoint.restore(tmp_path / "whole")["w"]), values)
    _save_damaged(tmp_path / "damaged", jax.device_put(values, sharding), 0.5, 64)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=damaged_bytes(r"w\[(0:50000|50000:100000)\]", tmp_path / "damaged"),
    ):
        checkpoint.restore(tmp_path / "damaged")


def _without_record(directory: Path, step: int = 0) -> None:
    edit_json(directory / str(step) / "_CHECKPOINT_METADATA", lambda value: {**value, "custom_metadata": {}})


def test_a_step_saved_without_checksums_restores_unchecked(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    # As saved before jaxstrategy wrote them: neither the item nor the record.
    shutil.rmtree(tmp_path / "0" / "checksums")
    _without_record(tmp_path)
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("where", ["record", "file"])
def test_checksums_of_an_unknown_algorithm_are_a_clear_error(tmp_path, where):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    edited = (
        tmp_path / "0" / ("_CHECKPOINT_METADATA" if where == "record" else "checksums/process_0-of-1.json")
    )
    edited.write_text(edited.read_text().replace('"crc32', '"sha3'))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path) + r"its checksums are of the algorithm 'sha3c'.* knows only 'crc32c'.*"
        r"Upgrade jaxstrategy, or restore with verify=False\.$",
    ):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)


# --- every edit is caught (issue 26) -----------------------------------------------------------
# Each test below edits a saved step as damage or a hand would, and expects a CorruptCheckpointError
# naming the step and the item or leaf. The checksums of jaxstrategy before CRC32C (the sums of
# 4 KiB blocks) let each of these edits through; the comment on each says how.


def test_two_floats_swapped_at_an_even_distance_in_one_block_are_caught(tmp_path):
    # Before: float32s at an even distance are the same half of two 64-bit words, so a block's sum
    # of words does not change when they swap.
    values = np.random.default_rng(2).standard_normal(4096, dtype=np.float32)
    checkpoint.save(tmp_path, {"w": values})
    swapped = values.copy()
    swapped[[10, 14]] = swapped[[14, 10]]
    transplant_state(tmp_path, {"w": swapped})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=damaged_bytes("w", tmp_path)):
        checkpoint.restore(tmp_path)
    assert np.array_equal(np.asarray(checkpoint.restore(tmp_path, verify=False)["w"]), swapped)


def test_the_even_indexed_floats_of_a_block_permuted_are_caught(tmp_path):
    # Before: the low halves of a block's words, permuted, add up to the same sum.
    values = np.random.default_rng(3).standard_normal(4096, dtype=np.float32)
    checkpoint.save(tmp_path, {"w": jnp.asarray(values)})
    permuted = values.copy()
    permuted[1024:2048:2] = np.random.default_rng(4).permutation(permuted[1024:2048:2])
    transplant_state(tmp_path, {"w": jnp.asarray(permuted)})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=damaged_bytes("w", tmp_path)):
        checkpoint.restore(tmp_path)


def test_a_numpy_scalar_leaf_is_checked(tmp_path):
    # Before: a numpy scalar (not an ndarray, nor a jax.Array) got no checksum.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "step": np.int32(7)})
    transplant_state(tmp_path, {"w": jnp.ones(3), "step": np.int32(8)})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=damaged_bytes("step", tmp_path)):
        checkpoint.restore(tmp_path)


def test_one_changed_digit_in_the_iterator_positions_is_caught(tmp_path):
    # Before: the iterators item had no checksum, and the edited position skipped a batch.
    strategy = jaxstrategy.OneDeviceStrategy()
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "data": iterator_after(strategy, 2)})
    positions = tmp_path / "0" / "iterators" / "process_0-of-1.json"
    positions.write_text(positions.read_text().replace('"batches": 2', '"batches": 3'))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=rf"(?s)iterator positions of the checkpoint at step 0 in {re.escape(str(tmp_path))}: "
        rf"the file process_0-of-1\.json differs .*\(crc32c {HEX}, saved {HEX}\).*verify=False",
    ):
        checkpoint.restore(tmp_path, target={"w": jnp.ones(3), "data": iterator_after(strategy, 0)})


def _json_item_changed(directory: Path, item: str) -> str:
    return _at_step(directory) + rf"its item '{item}' differs .*\(crc32c {HEX}, saved {HEX}\).*verify=False"


def test_an_edited_zero_size_shape_is_caught(tmp_path):
    # Before: the edited shape came back, unchecked.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "empty": jnp.zeros((0, 3))})
    edit_json(tmp_path / "0" / "zero_size_shapes" / "metadata", lambda value: {**value, "empty": [0, 4]})
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=_json_item_changed(tmp_path, "zero_size_shapes")
    ):
        checkpoint.restore(tmp_path)


def test_an_edited_prng_key_implementation_is_caught(tmp_path):
    # Before: JAX's own TypeError, from wrapping threefry key data as rbg keys.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "key": jax.random.key(0)})
    edit_json(tmp_path / "0" / "prng_keys" / "metadata", lambda value: {**value, "key": "rbg"})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_json_item_changed(tmp_path, "prng_keys")):
        checkpoint.restore(tmp_path)


@pytest.mark.parametrize(
    ("edit", "missing"),
    [
        (lambda record: {**record, "leaves": {}}, ["b/c: 0 of its 2 elements", "w: 0 of its 3 elements"]),
        (
            lambda record: {**record, "leaves": {k: v for k, v in record["leaves"].items() if k != "b/c"}},
            ["b/c: 0 of its 2 elements"],
        ),
    ],
    ids=["emptied", "one leaf dropped"],
)
def test_checksums_that_miss_a_leaf_are_caught(tmp_path, edit, missing):
    # Before: a leaf without a checksum restored unchecked, as from before checksums.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "b": {"c": jnp.zeros(2)}})
    for path in (tmp_path / "0" / "checksums").glob("*.json"):
        edit_json(path, edit)
    # Every leaf missed, one per line, and no other.
    listed = "".join(rf"\n  {re.escape(line)} have a checksum" for line in missing)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path) + rf"its checksums do not cover all of these leaves.*:{listed}\n"
        r"Restore another step, or restore with verify=False",
    ):
        checkpoint.restore(tmp_path)


def test_a_deleted_checksums_item_is_caught(tmp_path):
    # Before: the step read as one saved before checksums, and restored unchecked.
    checkpoint.save(tmp_path, {"w": jnp.ones(3)})
    shutil.rmtree(tmp_path / "0" / "checksums")
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path) + r"it was saved with crc32c checksums .*'checksums' item lacks the file "
        r"process_0-of-1\.json.*verify=False to read it unchecked\.$",
    ):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("item", ["zero_size_shapes", "iterators"])
def test_a_deleted_json_item_is_caught(tmp_path, item):
    # Before: without `zero_size_shapes`, the empty array came back as a scalar; without
    # `iterators`, the restored tree had no position.
    strategy = jaxstrategy.OneDeviceStrategy()
    checkpoint.save(tmp_path, {"empty": jnp.zeros((0, 3)), "data": iterator_after(strategy, 1)})
    shutil.rmtree(tmp_path / "0" / item)
    name = "zero_size_shapes" if item == "zero_size_shapes" else "iterators/process_0-of-1.json"
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + rf"its checksums name {re.escape(repr(name))}, which the step lacks.*verify=False",
    ):
        checkpoint.restore(tmp_path)


def test_a_leaf_sharded_over_devices_is_checked_shard_by_shard_onto_any_sharding(tmp_path, cpu_devices):
    # Before: one checksum of the whole leaf, assembled on the host to be summed; now one per
    # shard, as orbax was handed it, named by its region when one is damaged.
    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.random.default_rng(5).standard_normal(1000, dtype=np.float32)
    checkpoint.save(tmp_path, {"w": jax.device_put(values, sharding)})
    leaves = json.loads((tmp_path / "0" / "checksums" / "process_0-of-1.json").read_text())["leaves"]
    assert sorted(leaves["w"]) == ["0:500", "500:1000"]
    damaged = values.copy()
    damaged[700] += 1
    transplant_state(tmp_path, {"w": jax.device_put(damaged, sharding)})
    for strategy in (
        jaxstrategy.OneDeviceStrategy("/cpu:3"),
        jaxstrategy.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    ):
        with pytest.raises(
            checkpoint.CorruptCheckpointError, match=damaged_bytes(re.escape("w[500:1000]"), tmp_path)
        ):
            checkpoint.restore(tmp_path, strategy=strategy)


def test_the_record_of_a_checksummed_step_is_required(tmp_path):
    # Before: there was no record; without one, a missing or emptied checksums item went unseen.
    checkpoint.save(tmp_path, {"w": jnp.ones(3)})
    _without_record(tmp_path)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path) + r"its 'checksums' item holds crc32c checksums, but its "
        r"_CHECKPOINT_METADATA has no record of them.*verify=False to read it unchecked\.$",
    ):
        checkpoint.restore(tmp_path)


# --- checking restored arrays, however split -----------------------------------------------------


def _saved_regions(values: np.ndarray, sharding) -> dict:
    array = jax.device_put(values, sharding)
    return {
        regions.region_of(shard.index, values.shape): checksums.crc32c(np.asarray(shard.data))
        for shard in array.addressable_shards
        if shard.replica_id == 0
    }


@pytest.mark.parametrize(
    "onto",
    ["one device", "replicated", "4 row shards", "2x2", "2 column shards"],
)
def test_saved_shards_are_checked_from_whatever_sharding_they_restore_onto(cpu_devices, onto):
    # Saved as two row shards; restored onto shards that contain a saved one (sliced from it), or
    # that each hold a part of it (assembled).
    def sharding(shape, spec):
        mesh = jax.sharding.Mesh(
            np.array(cpu_devices[: math.prod(shape)]).reshape(shape), ("x", "y")[: len(shape)]
        )
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

    shardings = {
        "one device": jax.sharding.SingleDeviceSharding(cpu_devices[2]),
        "replicated": sharding((4,), ()),
        "4 row shards": sharding((4,), ("x",)),
        "2x2": sharding((2, 2), ("x", "y")),
        "2 column shards": sharding((2,), (None, "x")),
    }
    values = np.random.default_rng(6).standard_normal((8, 6), dtype=np.float32)
    saved = {"w": _saved_regions(values, sharding((2,), ("x",)))}
    assert sorted(saved["w"]) == [((0, 4), (0, 6)), ((4, 8), (0, 6))]
    restored = {"w": jax.device_put(values, shardings[onto])}
    assert verification.mismatches(restored, saved) == verification.Findings()
    damaged = values.copy()
    damaged[5, 4] += 1
    findings = verification.mismatches({"w": jax.device_put(damaged, shardings[onto])}, saved)
    found = findings.damaged
    assert findings.unchecked == [] and findings.partial == {} and len(found) == 1
    assert re.fullmatch(rf"w\[4:8, 0:6\]: crc32c {HEX}, saved {HEX}", found[0]), found


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_a_region_s_checksum_is_put_together_from_partial_sums_of_its_parts(parts):
    # How a region split between processes is checked: each sums its parts, zeros elsewhere.
    values = np.random.default_rng(8).standard_normal((5, 7), dtype=np.float32)
    owner = np.arange(values.size).reshape(values.shape) % parts  # Interleaved, as columns split.
    partial = {
        process: {
            "w[0:5, 0:7]": (
                checksums.crc32c(values),
                checksums.crc32c(np.where(owner == process, values, 0)),
                values.nbytes,
            )
        }
        for process in range(parts)
    }
    assert verification.combine(partial) == []
    damaged = values.copy()
    damaged[3, 6] = np.nextafter(damaged[3, 6], np.inf)  # One bit.
    partial[int(owner[3, 6])]["w[0:5, 0:7]"] = (
        checksums.crc32c(values),
        checksums.crc32c(np.where(owner == owner[3, 6], damaged, 0)),
        values.nbytes,
    )
    (line,) = verification.combine(partial)
    processes = ", ".join(map(str, range(parts)))
    assert re.fullmatch(
        rf"w\[0:5, 0:7\]: crc32c {HEX}, saved {HEX} \(split over processes {processes}\)", line
    ), line


def test_regions_are_covered_only_by_parts_holding_all_their_elements():
    assert regions.covered(((0, 8),), [((0, 4),), ((4, 8),), ((0, 4),)])
    assert not regions.covered(((0, 8),), [((0, 4),)])
    assert regions.covered(((2, 4), (0, 6)), [((0, 8), (0, 3)), ((0, 8), (3, 6))])
    assert not regions.covered(((2, 4), (0, 6)), [((0, 8), (0, 3)), ((0, 3), (3, 6))])
    assert regions.covered((), [()])  # A scalar.


# --- damaged checksums ---------------------------------------------------------------------------


def _edit_record(edit):
    def apply(directory: Path) -> None:
        edit_json(
            directory / "0" / "_CHECKPOINT_METADATA",
            lambda value: {
                **value,
                "custom_metadata": {
                    **value["custom_metadata"],
                    "jaxstrategy_checksums": edit(value["custom_metadata"]["jaxstrategy_checksums"]),
                },
            },
        )

    return apply


def _edit_file(edit):
    def apply(directory: Path) -> None:
        path = directory / "0" / "checksums" / "process_0-of-1.json"
        path.write_text(edit(path.read_text()))

    return apply


def _edit_leaves(edit):
    return _edit_file(
        lambda text: json.dumps({**json.loads(text), "leaves": edit(json.loads(text)["leaves"])})
    )


_NOT_CHECKSUMS = r"its 'checksums' item's file process_0-of-1\.json is not a file of checksums"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_edit_record(lambda record: "crc32c"), r"its record of checksums is 'crc32c', not a JSON object"),
        (
            _edit_record(lambda record: {**record, "processes": 0}),
            r"its record of checksums names 0 processes, not a number >= 1",
        ),
        (
            _edit_file(lambda text: text[:-5]),
            r"its 'checksums' item's file process_0-of-1\.json is not JSON \(",
        ),
        (
            _edit_file(lambda text: text.replace('"leaves"', '"leafs"')),
            _NOT_CHECKSUMS + r" \(KeyError\('leaves'\)\)",
        ),
        (
            _edit_leaves(lambda leaves: {**leaves, "w": {"0-3": 1}}),
            _NOT_CHECKSUMS + r" \(ValueError\(\"'0-3' is not a region",
        ),
        (
            _edit_file(lambda text: text.replace('"prng_keys"', '"prng_key"')),
            r"its checksums name 'prng_key', which the step lacks",
        ),
        (
            _edit_file(lambda text: json.dumps({**json.loads(text), "items": {}})),
            r"its checksums name no 'prng_keys', which the step holds",
        ),
        (
            _edit_leaves(lambda leaves: {**leaves, "v": leaves["w"]}),
            r"its checksums do not cover all of these leaves.*:\n  v: has checksums, but the step holds no such leaf\n",
        ),
        (
            _edit_leaves(lambda leaves: {"w": {"0:4": leaves["w"]["0:3"]}}),
            r"its checksums do not cover all of these leaves.*:\n  w: 0 of its 3 elements have a checksum\n",
        ),
        (
            _edit_leaves(lambda leaves: {"w": {"0:3": leaves["w"]["0:3"] + 0.5}}),
            _NOT_CHECKSUMS + r" \(ValueError\('a checksum is [0-9.]+, not an int'\)\)",
        ),
    ],
    ids=[
        "record not an object",
        "record of 0 processes",
        "file not JSON",
        "file without leaves",
        "region not a region",
        "item renamed",
        "items emptied",
        "checksum of no leaf",
        "region outside the leaf",
        "checksum not an int",
    ],
)
def test_damaged_checksums_are_a_corrupt_checkpoint_saying_what_is_wrong(tmp_path, damage, message):
    checkpoint.save(tmp_path, {"w": jnp.ones(3)})
    damage(tmp_path)
    # What is wrong, then what to do.
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + message + r".*Restore another step"
    ):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_file_without_a_checksum_is_refused():
    # Restoring finds such a file first by the step's list of items; this is the handler's own guard.
    with pytest.raises(
        ValueError,
        match=r"(?s)the file process_1-of-2\.json has no checksum.*added or renamed.*verify=False",
    ):
        verification.check_file(
            "process_1-of-2.json", b"{}", {"process_0-of-2.json": checksums.crc32c(b"{}")}
        )
    verification.check_file("process_0-of-2.json", b"{}", {"process_0-of-2.json": checksums.crc32c(b"{}")})
