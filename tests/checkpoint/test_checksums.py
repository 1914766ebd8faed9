"""Checksums: damaged bytes are a CorruptCheckpointError naming the leaf; unchecked steps still restore."""

from __future__ import annotations

import json
import math
import re
import shutil
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_support import assert_bit_exact, every_kind_of_leaf, largest_file, zero_size_tree

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import checksums, regions, verification
from jaxstrategy.testing import run_local_workers

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


_DAMAGED = r"the bytes read for these leaves differ from those saved \(their checksums, written with the step, do not match\), so its files were damaged or changed after the save:\n  w: crc32c 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}\nRestore another step, or restore with verify=False"


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
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=_DAMAGED.replace("w:", r"w\[(0:50000|50000:100000)\]:")
    ):
        checkpoint.restore(tmp_path / "damaged")


def test_every_kind_of_leaf_restores_through_its_checksum(tmp_path):
    tree = {
        **every_kind_of_leaf(),
        "empty": zero_size_tree(),
        "i64": np.array([-(2**31)], np.int64),
    }
    checkpoint.save(tmp_path, tree)
    record = json.loads((tmp_path / "0" / "checksums" / "process_0-of-1.json").read_text())
    assert {"f32", "bf16/0", "keys/1", "empty/rows", "i64", "scalar"} <= record["leaves"].keys()
    assert record["leaves"]["f32"].keys() == {"0:3,0:4"} and record["leaves"]["scalar"].keys() == {""}
    assert record["items"].keys() == {"prng_keys", "zero_size_shapes"}
    restored = checkpoint.restore(tmp_path, target={**tree, "i64": np.zeros(1, np.int64)})
    assert_bit_exact({key: restored[key] for key in every_kind_of_leaf()}, every_kind_of_leaf())


def _without_record(directory: Path, step: int = 0) -> None:
    _edit_json(directory / str(step) / "_CHECKPOINT_METADATA", lambda value: {**value, "custom_metadata": {}})


def test_a_step_saved_without_checksums_restores_unchecked(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    # As saved before jaxstrategy wrote them: neither the item nor the record.
    shutil.rmtree(tmp_path / "0" / "checksums")
    _without_record(tmp_path)
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("where", ["record", "file", "former file"])
def test_checksums_of_an_unknown_algorithm_are_a_clear_error(tmp_path, where):
    if where == "former file":
        from test_format import FIXTURE

        directory, step = Path(shutil.copytree(FIXTURE, tmp_path / "checkpoint")), 7
        edited = directory / "7" / "checksums" / "checksums.json"
    else:
        directory, step = tmp_path, 0
        checkpoint.save(directory, {"w": jnp.arange(3.0)})
        edited = (
            directory
            / "0"
            / ("_CHECKPOINT_METADATA" if where == "record" else "checksums/process_0-of-1.json")
        )
    edited.write_text(edited.read_text().replace('"crc32', '"sha3'))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(directory, step)
        + re.escape(
            f"its checksums are of the algorithm {'sha3 of 4 KiB block sums' if where == 'former file' else 'sha3c'!r}, "
            "and this version of jaxstrategy knows only 'crc32c' (and 'crc32 of 4 KiB block sums', of "
            "earlier versions). Upgrade jaxstrategy, or restore with verify=False."
        )
        + "$",
    ):
        checkpoint.restore(directory)
    assert checkpoint.restore(directory, verify=False)


# --- every edit is caught (issue 26) -----------------------------------------------------------
# Each test below edits a saved step as damage or a hand would, and expects a CorruptCheckpointError
# naming the step and the item or leaf. The checksums of jaxstrategy before CRC32C (the sums of
# 4 KiB blocks) let each of these edits through; the comment on each says how.


def _transplant_state(directory: Path, tree, step: int = 0) -> None:
    """Replace the arrays of `step` in `directory` by `tree`'s, saved elsewhere: the bytes on disk
    change as damage would change them, and the rest of the step (its checksums) stays."""
    other = directory.parent / f"{directory.name}-edited"
    checkpoint.save(other, tree, step=step)
    shutil.rmtree(directory / str(step) / "state")
    shutil.copytree(other / str(step) / "state", directory / str(step) / "state")


def _edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    path.write_text(json.dumps(edit(value)))


def _damaged(leaf: str) -> str:
    """The message for damaged bytes of the one leaf (or region of one) named `leaf`."""
    return (
        r"the bytes read for these leaves differ from those saved \(their checksums, written with "
        r"the step, do not match\), so its files were damaged or changed after the save:\n  "
        f"{re.escape(leaf)}: crc32c 0x[0-9a-f]{{8}}, saved 0x[0-9a-f]{{8}}\\n"
    )


def _at_step(directory: Path, step: int = 0) -> str:
    return re.escape(f"Cannot read the checkpoint at step {step} in {directory}: ")


def test_two_floats_swapped_at_an_even_distance_in_one_block_are_caught(tmp_path):
    # Before: float32s at an even distance are the same half of two 64-bit words, so a block's sum
    # of words does not change when they swap.
    values = np.random.default_rng(2).standard_normal(4096, dtype=np.float32)
    checkpoint.save(tmp_path, {"w": values})
    swapped = values.copy()
    swapped[[10, 14]] = swapped[[14, 10]]
    _transplant_state(tmp_path, {"w": swapped})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + _damaged("w")):
        checkpoint.restore(tmp_path)
    assert np.array_equal(np.asarray(checkpoint.restore(tmp_path, verify=False)["w"]), swapped)


def test_the_even_indexed_floats_of_a_block_permuted_are_caught(tmp_path):
    # Before: the low halves of a block's words, permuted, add up to the same sum.
    values = np.random.default_rng(3).standard_normal(4096, dtype=np.float32)
    checkpoint.save(tmp_path, {"w": jnp.asarray(values)})
    permuted = values.copy()
    permuted[1024:2048:2] = np.random.default_rng(4).permutation(permuted[1024:2048:2])
    _transplant_state(tmp_path, {"w": jnp.asarray(permuted)})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + _damaged("w")):
        checkpoint.restore(tmp_path)


def test_a_numpy_scalar_leaf_is_checked(tmp_path):
    # Before: a numpy scalar (not an ndarray, nor a jax.Array) got no checksum.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "step": np.int32(7)})
    _transplant_state(tmp_path, {"w": jnp.ones(3), "step": np.int32(8)})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + _damaged("step")):
        checkpoint.restore(tmp_path)


def _iterator(strategy, taken: int):
    iterator = iter(strategy.experimental_distribute_dataset([np.full(2, i, np.float32) for i in range(6)]))
    for _ in range(taken):
        next(iterator)
    return iterator


def test_one_changed_digit_in_the_iterator_positions_is_caught(tmp_path):
    # Before: the iterators item had no checksum, and the edited position skipped a batch.
    strategy = jaxstrategy.OneDeviceStrategy()
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "data": _iterator(strategy, 2)})
    positions = tmp_path / "0" / "iterators" / "process_0-of-1.json"
    positions.write_text(positions.read_text().replace('"batches": 2', '"batches": 3'))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=re.escape(
            f"Cannot read the iterator positions of the checkpoint at step 0 in {tmp_path}: the file "
            "process_0-of-1.json differs from the one saved (crc32c 0x"
        )
        + r"[0-9a-f]{8}, saved 0x[0-9a-f]{8}\), so it was damaged or changed after the save\. Restore "
        r"another step, or restore with verify=False to read it anyway\.$",
    ):
        checkpoint.restore(tmp_path, target={"w": jnp.ones(3), "data": _iterator(strategy, 0)})


def _json_item_changed(directory: Path, item: str) -> str:
    return (
        _at_step(directory)
        + re.escape(f"its item {item!r} differs from the one saved (crc32c 0x")
        + (
            r"[0-9a-f]{8}, saved 0x[0-9a-f]{8}\), so its files were damaged or changed after the save\. "
            r"Restore another step, or restore with verify=False to read it anyway\.$"
        )
    )


def test_an_edited_zero_size_shape_is_caught(tmp_path):
    # Before: the edited shape came back, unchecked.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "empty": jnp.zeros((0, 3))})
    shapes = tmp_path / "0" / "zero_size_shapes" / "metadata"
    _edit_json(shapes, lambda value: {**value, "empty": [0, 4]})
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=_json_item_changed(tmp_path, "zero_size_shapes")
    ):
        checkpoint.restore(tmp_path)


def test_an_edited_prng_key_implementation_is_caught(tmp_path):
    # Before: JAX's own TypeError, from wrapping threefry key data as rbg keys.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "key": jax.random.key(0)})
    _edit_json(tmp_path / "0" / "prng_keys" / "metadata", lambda value: {**value, "key": "rbg"})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_json_item_changed(tmp_path, "prng_keys")):
        checkpoint.restore(tmp_path)


def test_an_orbax_json_item_reformatted_without_a_change_is_no_damage(tmp_path):
    # Orbax writes `prng_keys` and `zero_size_shapes`: their checksum is of their content
    # (canonical JSON), not of orbax's formatting.
    tree = {"key": jax.random.key(0), "empty": jnp.zeros((0, 3))}
    checkpoint.save(tmp_path, tree)
    for item in ("prng_keys", "zero_size_shapes"):
        path = tmp_path / "0" / item / "metadata"
        path.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    assert_bit_exact(checkpoint.restore(tmp_path), tree)


@pytest.mark.parametrize(
    ("edit", "what"),
    [
        (lambda record: {**record, "leaves": {}}, "emptied"),
        (
            lambda record: {**record, "leaves": {k: v for k, v in record["leaves"].items() if k != "b/c"}},
            "one leaf dropped",
        ),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_checksums_that_miss_a_leaf_are_caught(tmp_path, edit, what):
    # Before: a leaf without a checksum restored unchecked, as from before checksums.
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "b": {"c": jnp.zeros(2)}})
    for path in (tmp_path / "0" / "checksums").glob("*.json"):
        _edit_json(path, edit)
    missing = ["b/c: 0 of its 2 elements have a checksum"]
    if what == "emptied":
        missing.append("w: 0 of its 3 elements have a checksum")
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + re.escape(
            "its checksums do not cover all of these leaves, so its 'checksums' item was damaged or "
            "changed after the save:\n  " + "\n  ".join(missing) + "\nRestore another "
            "step, or restore with verify=False to read it unchecked."
        )
        + "$",
    ):
        checkpoint.restore(tmp_path)


def test_a_deleted_checksums_item_is_caught(tmp_path):
    # Before: the step read as one saved before checksums, and restored unchecked.
    checkpoint.save(tmp_path, {"w": jnp.ones(3)})
    shutil.rmtree(tmp_path / "0" / "checksums")
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + re.escape(
            "it was saved with crc32c checksums (its _CHECKPOINT_METADATA says so), but its "
            "'checksums' item lacks the file process_0-of-1.json, so its files were damaged or changed "
            "after the save. Restore another step, or restore with verify=False to read it unchecked."
        )
        + "$",
    ):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("item", ["zero_size_shapes", "iterators"])
def test_a_deleted_json_item_is_caught(tmp_path, item):
    # Before: without `zero_size_shapes`, the empty array came back as a scalar; without
    # `iterators`, the restored tree had no position.
    strategy = jaxstrategy.OneDeviceStrategy()
    checkpoint.save(tmp_path, {"empty": jnp.zeros((0, 3)), "data": _iterator(strategy, 1)})
    shutil.rmtree(tmp_path / "0" / item)
    name = "zero_size_shapes" if item == "zero_size_shapes" else "iterators/process_0-of-1.json"
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + re.escape(
            f"its checksums name {name!r}, which the step lacks, so its files were damaged or changed "
            "after the save. Restore another step, or restore with verify=False to read it unchecked."
        ),
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
    _transplant_state(tmp_path, {"w": jax.device_put(damaged, sharding)})
    for strategy in (
        jaxstrategy.OneDeviceStrategy("/cpu:3"),
        jaxstrategy.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    ):
        with pytest.raises(
            checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + _damaged("w[500:1000]")
        ):
            checkpoint.restore(tmp_path, strategy=strategy)


def test_the_record_of_a_checksummed_step_is_required(tmp_path):
    # Before: there was no record; without one, a missing or emptied checksums item went unseen.
    checkpoint.save(tmp_path, {"w": jnp.ones(3)})
    _without_record(tmp_path)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + re.escape(
            "its 'checksums' item holds crc32c checksums, but its _CHECKPOINT_METADATA has no record of "
            "them (every step saved with them has one), so that file was damaged or changed after the "
            "save. Restore another step, or restore with verify=False to read it unchecked."
        )
        + "$",
    ):
        checkpoint.restore(tmp_path)


def test_a_checkpoint_of_the_former_algorithm_is_still_verified(tmp_path):
    # The fixture's checksums are the sums of 4 KiB blocks, and still read as such.
    from test_format import FIXTURE, _saved_arrays

    saved = Path(shutil.copytree(FIXTURE, tmp_path / "checkpoint"))
    arrays = _saved_arrays()
    arrays["params"]["dense"]["kernel"] = arrays["params"]["dense"]["kernel"].at[1, 2].add(1.0)
    _transplant_state(saved, {**arrays, "data": _iterator(jaxstrategy.OneDeviceStrategy(), 0)}, step=7)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(saved, 7)
        + r"the bytes read for these leaves differ from those saved \(their checksums, written with "
        r"the step, do not match\), so its files were damaged or changed after the save:\n  "
        r"params/dense/kernel: checksum 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}\n",
    ):
        checkpoint.restore(saved)


_JOB = textwrap.dedent(
    """
    import json, sys, warnings
    import jax, numpy as np
    import jaxstrategy
    from jaxstrategy import checkpoint
    from jaxstrategy._src.checkpoint import checksums, restore

    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    # 16 floats sharded over the job's 4 devices, 2 in each process: no process holds them all.
    sharding = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array(jax.devices()), ("x",)), jax.sharding.PartitionSpec("x")
    )
    values = np.arange(16, dtype=np.float32)
    w = jax.make_array_from_callback(values.shape, sharding, lambda index: values[index])
    batches = [np.full(4, i, np.float32) for i in range(6)]
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    next(iterator)
    tree = {"w": w, "r": strategy.put(np.ones(3, np.float32)), "step": np.int32(5), "data": iterator}
    checkpoint.save(sys.argv[1], tree, step=0)
    restored = checkpoint.restore(sys.argv[1], strategy=strategy, target=tree)

    # Restored split over the processes otherwise than saved: 4:8 is held whole by process 1
    # alone, which checks it; 8:16 by none, so both check it together from their parts.
    devices = jax.devices()
    interleaved = jax.sharding.NamedSharding(
        jax.sharding.Mesh(np.array([devices[0], devices[2], devices[1], devices[3]]), ("x",)),
        jax.sharding.PartitionSpec("x"),
    )
    split = jax.make_array_from_callback(values.shape, interleaved, lambda index: values[index])
    said = []
    # 0:4 and 8:16 damaged, then neither.
    for first, last in ((0, 0), (checksums.crc32c(values[0:4]), checksums.crc32c(values[8:16]))):
        regions = {"w": {((0, 4),): first, ((4, 8),): checksums.crc32c(values[4:8]), ((8, 16),): last}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                restore._verify({"w": split}, regions, checksums.CRC32C_SUMS, "the job")
            except checkpoint.CorruptCheckpointError as error:
                caught.append(error)
        said.append([str(getattr(w, "message", w)) for w in caught])
    print(json.dumps({"w": np.asarray(restored["w"]).tolist(), "said": said}), flush=True)
    """
)


@pytest.mark.slow  # Starts a job of two processes.
# Restored in one process, the job's iterator positions are not (test_iterators.py says why).
@pytest.mark.filterwarnings("ignore:The iterator positions:UserWarning")
def test_each_process_of_a_job_checksums_its_own_shards_and_positions(tmp_path):
    # Before: the primary process alone wrote checksums, of the leaves it held whole, so `w`,
    # sharded over the processes, had none, and process 1's iterator position none either.
    results = run_local_workers(["-c", _JOB, str(tmp_path)], devices_per_worker=2, timeout=240)
    assert [result.returncode for result in results] == [0, 0], [r.stderr[-3000:] for r in results]
    seen = [json.loads(result.stdout.splitlines()[-1]) for result in results]
    assert [process["w"] for process in seen] == [list(map(float, range(16)))] * 2
    # Process 0 holds 0:4 (its checksum, 0, is wrong: found), process 1 holds 4:8 (right), the
    # two of them 8:16 (wrong: found from both parts), and both raise: process 1 alone would go
    # on into a step and wait there for process 0.
    for process in seen:
        (damaged,) = process["said"][0]
        assert re.fullmatch(
            r"Cannot read the checkpoint at the job: the bytes read for these leaves differ from those "
            r"saved .*:\n  w\[0:4\]: crc32c 0x[0-9a-f]{8}, saved 0x00000000 \(found by process 0\)\n"
            r"  w\[8:16\]: crc32c 0x[0-9a-f]{8}, saved 0x00000000 \(split over processes 0, 1\)\n.*",
            damaged,
            re.DOTALL,
        ), process["said"]
    # Right, they restore without a word: no region is left unchecked.
    assert [process["said"][1] for process in seen] == [[], []]
    files = {
        i: json.loads((tmp_path / "0" / "checksums" / f"process_{i}-of-2.json").read_text()) for i in range(2)
    }
    assert [sorted(files[i]["leaves"]["w"]) for i in range(2)] == [["0:4", "4:8"], ["12:16", "8:12"]]
    assert ("r" in files[0]["leaves"], "r" in files[1]["leaves"]) == (True, False)
    assert [sorted(files[i]["items"]) for i in range(2)] == [
        ["iterators/process_0-of-2.json", "prng_keys"],
        ["iterators/process_1-of-2.json"],
    ]
    values = np.arange(16, dtype=np.float32)
    with pytest.warns(UserWarning, match=r"iterator positions .* saved by a job of 2 processes"):
        in_one_process = checkpoint.restore(tmp_path)
    assert np.array_equal(np.asarray(in_one_process["w"]), values)

    values[13] = -1.0  # In process 1's half.
    strategy = jaxstrategy.MirroredStrategy(["/cpu:0", "/cpu:1", "/cpu:2", "/cpu:3"])
    sharding = jax.sharding.NamedSharding(strategy.mesh, jax.sharding.PartitionSpec("replica"))
    edited = {"w": jax.device_put(values, sharding), "r": np.ones(3, np.float32), "step": np.int32(5)}
    _transplant_state(tmp_path, {**edited, "data": _iterator(strategy, 0)})
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + _damaged("w[12:16]")):
        checkpoint.restore(tmp_path)

    (tmp_path / "0" / "checksums" / "process_1-of-2.json").unlink()
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=_at_step(tmp_path)
        + re.escape(
            "it was saved with crc32c checksums (its _CHECKPOINT_METADATA says so), but its "
            "'checksums' item lacks the file process_1-of-2.json, so its files"
        ),
    ):
        checkpoint.restore(tmp_path)


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
    assert (
        verification.mismatches({"w": jax.device_put(values, shardings[onto])}, saved)
        == verification.Findings()
    )
    damaged = values.copy()
    damaged[5, 4] += 1
    findings = verification.mismatches({"w": jax.device_put(damaged, shardings[onto])}, saved)
    found = findings.damaged
    assert findings.unchecked == [] and findings.partial == {} and len(found) == 1
    assert re.fullmatch(r"w\[4:8, 0:6\]: crc32c 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}", found[0]), found


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
        rf"w\[0:5, 0:7\]: crc32c 0x[0-9a-f]{{8}}, saved 0x[0-9a-f]{{8}} \(split over processes {processes}\)",
        line,
    ), line


def test_regions_are_covered_only_by_parts_holding_all_their_elements():
    assert regions.covered(((0, 8),), [((0, 4),), ((4, 8),), ((0, 4),)])
    assert not regions.covered(((0, 8),), [((0, 4),)])
    assert regions.covered(((2, 4), (0, 6)), [((0, 8), (0, 3)), ((0, 8), (3, 6))])
    assert not regions.covered(((2, 4), (0, 6)), [((0, 8), (0, 3)), ((0, 3), (3, 6))])
    assert regions.covered((), [()])  # A scalar.


def test_crc32c_is_the_standard_one_over_any_layout_and_size():
    assert checksums.crc32c(b"123456789") == 0xE3069283  # The check value of CRC-32C (RFC 3720).
    big = np.random.default_rng(7).integers(0, 256, 3 * 2**20 + 5, dtype=np.uint8)  # Several chunks.
    assert checksums.crc32c(big) == checksums.crc32c(big.tobytes())
    grid = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert checksums.crc32c(grid[:, 2:4]) == checksums.crc32c(np.ascontiguousarray(grid[:, 2:4]).tobytes())


def _edit_record(edit):
    def apply(directory: Path) -> None:
        metadata = directory / "0" / "_CHECKPOINT_METADATA"
        _edit_json(
            metadata,
            lambda value: {
                **value,
                "custom_metadata": {
                    "jaxstrategy_checksums": edit(value["custom_metadata"]["jaxstrategy_checksums"])
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


_NOT_CHECKSUMS = "its 'checksums' item's file process_0-of-1.json is not a file of checksums"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_edit_record(lambda record: "crc32c"), "its record of checksums is 'crc32c', not a JSON object."),
        (
            _edit_record(lambda record: {**record, "processes": 0}),
            "its record of checksums names 0 processes, not a number >= 1.",
        ),
        (_edit_file(lambda text: text[:-5]), "its 'checksums' item's file process_0-of-1.json is not JSON ("),
        (
            _edit_file(lambda text: text.replace('"leaves"', '"leafs"')),
            _NOT_CHECKSUMS + " (KeyError('leaves'))",
        ),
        (
            _edit_leaves(lambda leaves: {**leaves, "w": {"0-3": 1}}),
            _NOT_CHECKSUMS + " (ValueError(\"'0-3' is not a region",
        ),
        (
            _edit_file(lambda text: text.replace('"prng_keys"', '"prng_key"')),
            "its checksums name 'prng_key', which the step lacks",
        ),
        (
            _edit_file(lambda text: json.dumps({**json.loads(text), "items": {}})),
            "its checksums name no 'prng_keys', which the step holds, so its files were damaged or changed after the save.",
        ),
        (
            _edit_leaves(lambda leaves: {**leaves, "v": leaves["w"]}),
            "its checksums do not cover all of these leaves, so its 'checksums' item was damaged or changed "
            "after the save:\n  v: has checksums, but the step holds no such leaf\n",
        ),
        (
            _edit_leaves(lambda leaves: {"w": {"0:4": leaves["w"]["0:3"]}}),
            "its checksums do not cover all of these leaves, so its 'checksums' item was damaged or changed "
            "after the save:\n  w: 0 of its 3 elements have a checksum\n",
        ),
        (
            _edit_leaves(lambda leaves: {"w": {"0:3": leaves["w"]["0:3"] + 0.5}}),
            _NOT_CHECKSUMS + " (ValueError('a checksum is ",
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
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_at_step(tmp_path) + re.escape(message)):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_file_without_a_checksum_is_refused():
    # Restoring finds such a file first by the step's list of items; this is the handler's own guard.
    with pytest.raises(
        ValueError,
        match=re.escape(
            "the file process_1-of-2.json has no checksum, though the step was saved with them, so it "
            "was added or renamed after the save. Restore another step, or restore with verify=False to "
            "read it unchecked."
        ),
    ):
        verification.check_file(
            "process_1-of-2.json", b"{}", {"process_0-of-2.json": checksums.crc32c(b"{}")}
        )
    verification.check_file("process_0-of-2.json", b"{}", {"process_0-of-2.json": checksums.crc32c(b"{}")})


def test_a_step_the_interval_skips_takes_no_checksums(tmp_path, monkeypatch):
    taken = []
    save_args = checksums.save_args

    def counted(*args, **kwargs):
        taken.append(args)
        return save_args(*args, **kwargs)

    monkeypatch.setattr(checksums, "save_args", counted)
    with checkpoint.Checkpointer(tmp_path, save_interval_steps=2) as checkpointer:
        assert checkpointer.save(0, {"w": jnp.ones(3)})
        assert not checkpointer.save(1, {"w": jnp.ones(3)})  # Summing would copy every shard to the host.
    assert len(taken) == 1
