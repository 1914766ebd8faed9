"""Checkpoints of ShardedStrategy: each shard written once, each leaf restored onto its layout.

A checkpoint saved from replicas of S devices restores onto any strategy, and one saved from any
strategy onto a ShardedStrategy of any shape: each leaf where the target strategy places it (on a
ShardedStrategy split as `layout_of` says, each device holding 1/S of a large leaf, never the
whole model gathered onto every device), with every saved shard checked against its checksum.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from checkpoint_support import damaged_bytes, transplant_state
from jax.sharding import PartitionSpec

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint.stored_leaves import path_string

# The kernel (8 KiB) and its Adam moments are split; the bias (128 B) and the count are not.
_MIN_SHARD_BYTES = 1024
_KERNEL = "params/dense/kernel"

_STRATEGIES = {
    "sharded 1x4": lambda: jaxstrategy.ShardedStrategy(min_shard_bytes=_MIN_SHARD_BYTES),
    "sharded 2x2": lambda: jaxstrategy.ShardedStrategy(num_replicas=2, min_shard_bytes=_MIN_SHARD_BYTES),
    "sharded 1x2 on cpu 2-3": lambda: jaxstrategy.ShardedStrategy(
        ["/cpu:2", "/cpu:3"], min_shard_bytes=_MIN_SHARD_BYTES
    ),
    "one device": lambda: jaxstrategy.OneDeviceStrategy("/cpu:1"),
    "mirrored 4": lambda: jaxstrategy.MirroredStrategy(),
}
_SAVED_ON = ["sharded 1x4", "sharded 2x2"]
_OPTIMIZER = optax.adam(0.1)


def _model(key):
    return {
        "dense": {
            "kernel": jax.random.normal(key, (64, 32)),
            "bias": jnp.linspace(-1.0, 1.0, 32),
        }
    }


def _state(strategy):
    """Parameters and the Adam state of one update, so that no moment is all zeros."""
    params = strategy.init(_model, jax.random.key(0))
    opt_state = strategy.init(_OPTIMIZER.init, params)

    def update(params, opt_state):
        grads = jax.tree.map(jnp.sin, params)
        with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes Python floats and int32 counts.
            updates, opt_state = _OPTIMIZER.update(grads, opt_state)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}

    return strategy.init(update, params, opt_state)


def _by_path(tree):
    return {path_string(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_equal_leaf_for_leaf(restored, original):
    restored, original = _by_path(restored), _by_path(original)
    assert restored.keys() == original.keys()
    for name, leaf in original.items():
        assert restored[name].dtype == leaf.dtype, name
        assert np.array_equal(np.asarray(restored[name]), np.asarray(leaf)), name


def _assert_laid_out_as(strategy, restored):
    """Each leaf is committed where `strategy` places it, and on a ShardedStrategy the kernel and
    its moments are split, 1/S on each device, while the bias is whole on each."""
    if isinstance(strategy, jaxstrategy.ShardedStrategy):
        expected = _by_path(strategy.layout_of(restored))
    else:
        expected = dict.fromkeys(_by_path(restored), strategy.sharding)
    for name, leaf in _by_path(restored).items():
        assert leaf.committed, name
        assert leaf.sharding == expected[name], (name, leaf.sharding, expected[name])
    leaves = _by_path(restored)
    kernels = [name for name in leaves if name.endswith("dense/kernel")]
    assert len(kernels) == 3  # The kernel, Adam's mu and nu of it.
    for name in kernels:
        shards = leaves[name].addressable_shards
        assert len(shards) == len(strategy.extended.worker_devices), name
        if isinstance(strategy, jaxstrategy.ShardedStrategy):
            s = strategy.devices_per_replica
            assert leaves[name].sharding.spec == PartitionSpec("shard", None), name
            assert {shard.data.shape for shard in shards} == {(64 // s, 32)}, name
        else:
            assert {shard.data.shape for shard in shards} == {(64, 32)}, name
    for name in leaves:
        if name.endswith("dense/bias"):
            assert {shard.data.shape for shard in leaves[name].addressable_shards} == {(32,)}, name


@pytest.mark.parametrize("target", [True, False], ids=["with target", "without target"])
@pytest.mark.parametrize("onto", list(_STRATEGIES))
@pytest.mark.parametrize("saved_on", _SAVED_ON)
def test_saved_sharded_restores_onto_any_strategy_on_its_layout_and_back(tmp_path, saved_on, onto, target):
    # The target, when given, is ShapeDtypeStructs without shardings: the layout is the strategy's.
    saving, restoring = _STRATEGIES[saved_on](), _STRATEGIES[onto]()
    state = _state(saving)
    checkpoint.save(tmp_path / "there", state)
    restored = checkpoint.restore(
        tmp_path / "there", strategy=restoring, target=_abstract(state) if target else None
    )
    _assert_equal_leaf_for_leaf(restored, state)
    _assert_laid_out_as(restoring, restored)

    checkpoint.save(tmp_path / "back", restored)
    back = checkpoint.restore(tmp_path / "back", strategy=saving, target=state if target else None)
    _assert_equal_leaf_for_leaf(back, state)
    _assert_laid_out_as(saving, back)


def _abstract(tree):
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), tree)


def _special_leaves():
    """Leaves stored otherwise than they are held, each big enough to be split over 4 devices:
    typed PRNG keys (stored as their data), a zero-size array (stored as a scalar) and an int64
    array (read on the host, then narrowed while `jax_enable_x64` is off)."""
    return {
        "keys": jax.random.split(jax.random.key(3), 256),  # 2 KiB of threefry keys.
        "empty": np.zeros((0, 64), np.float32),
        "steps": np.arange(1024, dtype=np.int64),
    }


@pytest.mark.parametrize("target", [True, False], ids=["with target", "without target"])
def test_keys_zero_size_and_64_bit_leaves_restore_on_their_layouts(tmp_path, target):
    strategy = jaxstrategy.ShardedStrategy(num_replicas=2, min_shard_bytes=_MIN_SHARD_BYTES)
    checkpoint.save(tmp_path, _special_leaves())
    restored = checkpoint.restore(tmp_path, strategy=strategy, target=_special_leaves() if target else None)
    layout = strategy.layout_of(_special_leaves())  # Where `put` places them.
    assert layout["keys"].spec == PartitionSpec("shard") and layout["steps"].spec == PartitionSpec("shard")
    for name, leaf in restored.items():
        assert leaf.sharding.is_equivalent_to(layout[name], leaf.ndim), (name, leaf.sharding, layout[name])
    assert jax.random.key_impl(restored["keys"]) == jax.random.key_impl(_special_leaves()["keys"])
    assert np.array_equal(
        jax.random.key_data(restored["keys"]), jax.random.key_data(_special_leaves()["keys"])
    )
    assert {shard.data.shape for shard in restored["keys"].addressable_shards} == {(128,)}
    assert restored["empty"].shape == (0, 64)
    assert (restored["steps"].dtype, restored["steps"].tolist()) == (jnp.int32, list(range(1024)))
    assert {shard.data.shape for shard in restored["steps"].addressable_shards} == {(512,)}


def _stored_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in (directory / "0" / "state").rglob("*") if path.is_file())


def test_a_sharded_save_writes_each_shard_once(tmp_path):
    # Random floats, which zstd barely compresses: the bytes on disk are about the model's.
    values = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)  # 1 MiB
    model_bytes = values.nbytes
    sizes = {}
    for name in ("one device", "sharded 1x4", "sharded 2x2"):
        strategy = _STRATEGIES[name]()
        checkpoint.save(tmp_path / name, {"w": strategy.put(values)})
        sizes[name] = _stored_bytes(tmp_path / name)
        checksums_file = tmp_path / name / "0" / "checksums" / "process_0-of-1.json"
        regions = json.loads(checksums_file.read_text())["leaves"]["w"]
        # Each element summed once, not once per replica: orbax has each device write 1/R of its
        # replica's shard (replica-parallel), and the checksums are of exactly those parts.
        assert len(regions) == len(strategy.devices), (name, sorted(regions))
        rows = sorted(tuple(map(int, key.split(",")[0].split(":"))) for key in regions)
        assert [start for start, _ in rows] == [0, *(stop for _, stop in rows[:-1])], rows
        assert rows[-1][1] == 512, rows
    for name, size in sizes.items():
        assert model_bytes * 0.9 < size < model_bytes * 1.1, (name, size, model_bytes)


@pytest.mark.parametrize("onto", ["sharded 1x4", "sharded 2x2", "sharded 1x2 on cpu 2-3"])
def test_a_damaged_shard_is_found_restoring_onto_a_sharded_strategy_of_any_shape(tmp_path, onto):
    saving = _STRATEGIES["sharded 2x2"]()
    state = _state(saving)
    checkpoint.save(tmp_path / "step", state)
    kernel = np.asarray(state["params"]["dense"]["kernel"])
    damaged = kernel.copy()
    damaged[40, 3] += 1  # In the part of the second shard that replica 0 saved: rows 32 to 48.
    transplant_state(
        tmp_path / "step",
        {**state, "params": {"dense": {**state["params"]["dense"], "kernel": saving.put(damaged)}}},
    )
    restoring = _STRATEGIES[onto]()
    for target in (None, state):
        with pytest.raises(
            checkpoint.CorruptCheckpointError,
            match=damaged_bytes(re.escape(f"{_KERNEL}[32:48, 0:32]"), tmp_path / "step"),
        ):
            checkpoint.restore(tmp_path / "step", strategy=restoring, target=target)
    unchecked = checkpoint.restore(tmp_path / "step", strategy=restoring, target=state, verify=False)
    assert np.array_equal(np.asarray(unchecked["params"]["dense"]["kernel"]), damaged)


def _local_batches(strategy, batches):
    return [[np.asarray(part).tolist() for part in strategy.experimental_local_results(b)] for b in batches]


def test_an_iterator_saved_with_a_sharded_model_resumes_where_it_was(tmp_path):
    strategy = _STRATEGIES["sharded 2x2"]()
    batches = [np.arange(8, dtype=np.float32).reshape(4, 2) + 10 * i for i in range(5)]
    dataset = strategy.experimental_distribute_dataset(batches)
    iterator = iter(dataset)
    next(iterator), next(iterator)
    state = _state(strategy)
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(2, {"state": state, "data": iterator})
        checkpointer.wait()
        rest = _local_batches(strategy, iterator)
        fresh = iter(dataset)
        restored = checkpointer.restore(strategy=strategy, target={"state": state, "data": fresh})
    assert restored["data"] is fresh and len(rest) == 3
    assert _local_batches(strategy, fresh) == rest
    _assert_equal_leaf_for_leaf(restored["state"], state)
    _assert_laid_out_as(strategy, restored["state"])


def test_an_nnx_model_restores_in_place_on_its_annotated_layout(tmp_path):
    from flax import nnx

    class Dense(nnx.Module):
        def __init__(self, seed):
            # Split along its columns by annotation, where the default would split its rows.
            init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "shard"))
            self.dense = nnx.Linear(64, 32, kernel_init=init, rngs=nnx.Rngs(seed))

    strategy = _STRATEGIES["sharded 1x4"]()
    with jax.set_mesh(strategy.mesh):  # Where Flax's eager sharding finds the mesh.
        saved, fresh = Dense(0), Dense(1)
    checkpoint.save(tmp_path, {"model": saved})
    restored = checkpoint.restore(tmp_path, strategy=strategy, target={"model": fresh})
    assert restored["model"] is fresh
    kernel = fresh.dense.kernel.get_value()
    assert np.array_equal(np.asarray(kernel), np.asarray(saved.dense.kernel.get_value()))
    assert kernel.sharding.spec == PartitionSpec(None, "shard")
    assert {shard.data.shape for shard in kernel.addressable_shards} == {(64, 8)}
