"""What a save writes for checksums: a CRC32C of every part of a shard and JSON item, by the process
that writes it, and the record saying so."""

from __future__ import annotations

import json
import re
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_support import (
    HEX,
    assert_bit_exact,
    damaged_bytes,
    every_kind_of_leaf,
    iterator_after,
    transplant_state,
    zero_size_tree,
)

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import checksums
from jaxstrategy.testing import run_local_workers


def test_crc32c_is_the_standard_one_over_any_layout_and_size():
    assert checksums.crc32c(b"123456789") == 0xE3069283  # The check value of CRC-32C (RFC 3720).
    big = np.random.default_rng(7).integers(0, 256, 3 * 2**20 + 5, dtype=np.uint8)  # Several chunks.
    assert checksums.crc32c(big) == checksums.crc32c(big.tobytes())
    grid = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert checksums.crc32c(grid[:, 2:4]) == checksums.crc32c(np.ascontiguousarray(grid[:, 2:4]).tobytes())


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
    metadata = json.loads((tmp_path / "0" / "_CHECKPOINT_METADATA").read_text())
    assert metadata["custom_metadata"]["jaxstrategy_checksums"] == {"algorithm": "crc32c", "processes": 1}
    restored = checkpoint.restore(tmp_path, target={**tree, "i64": np.zeros(1, np.int64)})
    assert_bit_exact({key: restored[key] for key in every_kind_of_leaf()}, every_kind_of_leaf())


def test_an_orbax_json_item_reformatted_without_a_change_is_no_damage(tmp_path):
    # Orbax writes `prng_keys` and `zero_size_shapes`: their checksum is of their content
    # (canonical JSON), not of orbax's formatting.
    tree = {"key": jax.random.key(0), "empty": jnp.zeros((0, 3))}
    checkpoint.save(tmp_path, tree)
    for item in ("prng_keys", "zero_size_shapes"):
        path = tmp_path / "0" / item / "metadata"
        path.write_text(json.dumps(json.loads(path.read_text()), indent=4))
    assert_bit_exact(checkpoint.restore(tmp_path), tree)


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
        assert re.search(
            rf"(?s)at the job: the bytes read .*:\n"
            rf"  w\[0:4\]: crc32c {HEX}, saved 0x00000000 \(found by process 0\)\n"
            rf"  w\[8:16\]: crc32c {HEX}, saved 0x00000000 \(split over processes 0, 1\)\n",
            damaged,
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
    transplant_state(tmp_path, {**edited, "data": iterator_after(strategy, 0)})
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=damaged_bytes(re.escape("w[12:16]"), tmp_path)
    ):
        checkpoint.restore(tmp_path)

    (tmp_path / "0" / "checksums" / "process_1-of-2.json").unlink()
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=r"(?s)step 0 in .*'checksums' item lacks the file process_1-of-2\.json.*verify=False",
    ):
        checkpoint.restore(tmp_path)
