"""ShardedStrategy: the shared conformance suite on (replicas, devices per replica) = (1, 4),
(2, 2) and (4, 1), training against a plain `jax.jit` loop on one device, and the layout rules."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conformance import StrategyConformance
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxstrategy
from jaxstrategy import ShardedStrategy
from jaxstrategy.testing import assert_tree_on_strategy

SHAPES = [(1, 4), (2, 2), (4, 1)]

# The conformance suite's variables are small: split from 64 bytes up, so that its leaves are
# laid out over the shards too. Its odd-sized ones cannot be, and say so.
pytestmark = pytest.mark.filterwarnings("ignore:.*no dimension of it divides:UserWarning")


@pytest.fixture(params=SHAPES, ids=lambda shape: f"R{shape[0]}xS{shape[1]}")
def sharded_on_every_shape(request, cpu_devices):
    replicas, _ = request.param
    return ShardedStrategy(cpu_devices[:4], num_replicas=replicas, min_shard_bytes=64)


@pytest.fixture(params=SHAPES, ids=lambda shape: f"R{shape[0]}xS{shape[1]}")
def sharded_at_64_bytes(request, cpu_devices):
    replicas, _ = request.param
    return ShardedStrategy(cpu_devices[:4], num_replicas=replicas, min_shard_bytes=64)


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, sharded_on_every_shape):
        return sharded_on_every_shape


# --- a model big enough to split, trained against a plain jax.jit loop on one device ---------


def _mlp_params(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "dense1": {
            "kernel": rng.normal(size=(12, 64)).astype(np.float32) * 0.3,
            "bias": np.zeros(64, np.float32),
        },
        "dense2": {
            "kernel": rng.normal(size=(64, 3)).astype(np.float32) * 0.3,
            "bias": np.zeros(3, np.float32),
        },
    }


def _loss(params, x, y):
    hidden = jnp.tanh(x @ params["dense1"]["kernel"] + params["dense1"]["bias"])
    return jnp.mean((hidden @ params["dense2"]["kernel"] + params["dense2"]["bias"] - y) ** 2)


def _batches(count: int = 4, size: int = 16) -> list[tuple[np.ndarray, np.ndarray]]:
    # Examples differ, so replicas' gradients differ: a wrong reduction cannot pass.
    rng = np.random.default_rng(11)
    return [
        (rng.normal(size=(size, 12)).astype(np.float32), rng.normal(size=(size, 3)).astype(np.float32))
        for _ in range(count)
    ]


OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.5),
    "sgd_momentum": lambda: optax.sgd(0.5, momentum=0.9),
    "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.5)),
}


def _plain_jit_training(optimizer):
    """The reference: one device, the whole batch, a plain jax.jit step."""
    device = jax.devices()[0]
    params = jax.device_put(_mlp_params(), device)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for x, y in _batches():
        params, state, loss = step(params, state, x, y)
        losses.append(float(loss))
    return losses, params


def _sharded_training(strategy, optimizer):
    params = strategy.put(_mlp_params())
    state = strategy.init(optimizer.init, params)
    n = strategy.num_replicas_in_sync

    def step(params, state, batch):
        x, y = batch
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        context = jaxstrategy.get_replica_context()
        grads = context.all_reduce("mean", grads)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for batch in strategy.experimental_distribute_dataset(_batches()):
        params, state, loss = strategy.run(step, args=(params, state, batch))
        losses.append(float(strategy.reduce("sum", loss, axis=None)) / n)
    return losses, params, state


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_training_matches_a_plain_jit_loop_on_one_device(sharded_at_64_bytes, optimizer_name):
    expected_losses, expected_params = _plain_jit_training(OPTIMIZERS[optimizer_name]())
    losses, params, _ = _sharded_training(sharded_at_64_bytes, OPTIMIZERS[optimizer_name]())
    # Float32 sums in another order (per replica, then across replicas; split contractions):
    # a few ulps per step, well under any wrong scale (R or S times the gradient).
    np.testing.assert_allclose(losses, expected_losses, rtol=2e-6)
    chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-6)


def test_every_device_holds_a_part_of_every_large_leaf_after_training(sharded_at_64_bytes):
    strategy = sharded_at_64_bytes
    s = strategy.devices_per_replica
    _, params, state = _sharded_training(strategy, optax.sgd(0.5, momentum=0.9))
    momentum = state[0].trace
    for tree in (params, momentum):
        for name in ("dense1",):
            leaf = tree[name]["kernel"]  # 12 x 64 float32: split along its 64 columns.
            assert leaf.sharding.spec == (P(None, "shard") if s > 1 else P())
            for shard in leaf.addressable_shards:
                assert shard.data.shape == (12, 64 // s)
    assert_tree_on_strategy((params, state), strategy)


def test_adam_moments_are_laid_out_as_their_parameters(sharded_at_64_bytes):
    strategy = sharded_at_64_bytes
    params = strategy.put(_mlp_params())
    state = strategy.init(optax.adam(1e-3).init, params)
    adam = state[0]
    for moments in (adam.mu, adam.nu):
        jax.tree.map(lambda m, p: _assert_same_layout(m, p), moments, params)


def _assert_same_layout(a, b):
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)


def test_a_layout_that_follows_no_rule_is_kept_through_run(sharded_at_64_bytes):
    # An input placed otherwise than the rules say comes back as it went in: outputs follow the
    # inputs they replace.
    strategy = sharded_at_64_bytes
    if strategy.devices_per_replica == 1:
        pytest.skip("nothing to split")
    kernel = jax.device_put(np.ones((12, 64), np.float32), NamedSharding(strategy.mesh, P("shard", None)))
    assert strategy.layout_of(kernel).spec == P(None, "shard")
    new = strategy.run(lambda k: k * 2, args=(kernel,))
    assert new.sharding.spec == P("shard", None)


def test_a_training_loop_compiles_its_step_once(sharded_at_64_bytes):
    chex.clear_trace_counter()  # chex counts per function across the parameters.
    strategy = sharded_at_64_bytes
    optimizer = optax.sgd(0.1, momentum=0.9)
    params = strategy.put(_mlp_params())
    state = strategy.init(optimizer.init, params)

    @chex.assert_max_traces(n=1)
    def step(params, state, batch):
        x, y = batch
        grads = jax.grad(_loss)(params, x, y)
        grads = jaxstrategy.get_replica_context().all_reduce("mean", grads)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for batch in strategy.experimental_distribute_dataset(_batches()):
        params, state = strategy.run(step, args=(params, state, batch))


def test_state_per_device_is_a_share_of_mirrored(cpu_devices):
    # The goal: at most 1/S of MirroredStrategy's bytes per device, plus 5%.
    params = {"kernel": np.ones((256, 512), np.float32), "bias": np.ones(512, np.float32)}
    optimizer = optax.adam(1e-3)

    def per_device_bytes(strategy):
        placed = strategy.put(params)
        tree = (placed, strategy.init(optimizer.init, placed))
        held: dict = {}
        for leaf in jax.tree.leaves(tree):
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        return max(held.values())

    mirrored = per_device_bytes(jaxstrategy.MirroredStrategy(cpu_devices[:4]))
    for replicas in (1, 2):
        strategy = ShardedStrategy(cpu_devices[:4], num_replicas=replicas, min_shard_bytes=4096)
        s = strategy.devices_per_replica
        assert per_device_bytes(strategy) <= mirrored / s * 1.05


# --- per-replica collectives on every shape ---------------------------------------------------


def test_a_raw_psum_over_replica_works(sharded_on_every_shape):
    strategy = sharded_on_every_shape
    n = strategy.num_replicas_in_sync
    values = strategy.experimental_distribute_values_from_function(
        lambda context: jnp.full((4,), context.replica_id_in_sync_group + 1.0)
    )
    total = strategy.run(lambda v: jax.lax.psum(v, "replica"), args=(values,))
    np.testing.assert_allclose(np.asarray(total), np.full(4, n * (n + 1) / 2))


def test_nnx_batch_norm_over_the_replica_axis(sharded_on_every_shape):
    strategy = sharded_on_every_shape
    n = strategy.num_replicas_in_sync
    model = nnx.BatchNorm(3, axis_name="replica", rngs=nnx.Rngs(0))
    strategy.put(model)
    rng = np.random.default_rng(0)
    data = rng.normal(size=(4 * n, 3)).astype(np.float32) * np.arange(1, 4 * n + 1, dtype=np.float32)[:, None]

    def step(model, x):
        return model(x)

    (batch,) = strategy.experimental_distribute_dataset([data])
    strategy.run(step, args=(model, batch))
    # Statistics over the whole global batch, as one BatchNorm on one device computes them.
    expected = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    expected(jnp.asarray(data))
    np.testing.assert_allclose(np.asarray(model.mean[...]), np.asarray(expected.mean[...]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.var[...]), np.asarray(expected.var[...]), rtol=1e-5)


# --- what ShardedStrategy refuses, and layouts from NNX annotations --------------------------


def test_num_replicas_must_divide_the_devices(cpu_devices):
    with pytest.raises(
        ValueError, match=r"num_replicas=3 does not divide the 4 devices; .* among \[1, 2, 4\]"
    ):
        ShardedStrategy(cpu_devices[:4], num_replicas=3)
    with pytest.raises(ValueError, match=r"num_replicas must be a positive int; got 0"):
        ShardedStrategy(cpu_devices[:4], num_replicas=0)


def test_a_bad_device_list_is_refused_naming_sharded_strategy():
    with pytest.raises(TypeError, match=r"ShardedStrategy\(devices='/cpu:0'\): expected a list or tuple"):
        ShardedStrategy("/cpu:0")


def test_each_replica_holds_its_part_of_a_batch_whole_on_each_of_its_devices(cpu_devices):
    # As Keras's ModelParallel lays its batch out: XLA then splits each layer's computation
    # along the split weights, and only activations move (bench/sharded.py: 5x faster, and a
    # third of the memory, than splitting the part over the replica's devices too).
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=2)
    batch = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)  # 3 per replica: S need not divide it.
    (placed,) = strategy.experimental_distribute_dataset([batch])
    for i, part in enumerate(strategy.experimental_local_results(placed)):
        assert part.devices() == set(cpu_devices[2 * i : 2 * i + 2])
        assert all(shard.data.shape == (3, 3) for shard in part.addressable_shards)
        np.testing.assert_array_equal(np.asarray(part), batch[3 * i : 3 * i + 3])


def test_describe_layout_names_what_decided_each_leaf(cpu_devices):
    strategy = ShardedStrategy(
        cpu_devices[:4], layout=[("dense2/kernel", P()), ("typo", P())], min_shard_bytes=64
    )
    table = strategy.describe_layout(_mlp_params())
    reasons = {row.path: row.reason for row in table.rows}
    assert reasons == {
        "dense1/bias": "default: largest dimension 4 divides",
        "dense1/kernel": "default: largest dimension 4 divides",
        "dense2/bias": "replicated: under min_shard_bytes (64 B)",
        "dense2/kernel": "rule 'dense2/kernel'",
    }
    assert table.unmatched_rules == ("typo",)
    assert "rule 'typo' matched no leaf" in str(table)
    with pytest.warns(UserWarning, match=r"the layout rule 'typo' matched no leaf"):
        strategy.put(_mlp_params())


def test_nnx_annotations_decide_the_layout_through_logical_rules(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=2, min_shard_bytes=0)
    with jax.set_mesh(strategy.mesh), nnx.logical_axis_rules([("hidden", "shard")]):
        model = nnx.Linear(
            8,
            6,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("hidden", None)),
            rngs=nnx.Rngs(0),
        )
    # Logical names mean nothing without their rules: each call that lays the model out needs them.
    with pytest.raises(
        ValueError,
        match=r"annotated \('hidden', None\), naming 'hidden'.*logical_axis_rules\(\[\('hidden', 'shard'\)",
    ):
        strategy.put(model)
    with nnx.logical_axis_rules([("hidden", "shard")]):
        rows = {row.path: row for row in strategy.describe_layout(nnx.state(model)).rows}
        assert rows["kernel"].reason == "Flax Variable annotation" and rows["kernel"].spec == P("shard", None)
        strategy.put(model)
    assert model.kernel[...].sharding.spec == P("shard", None)


def test_an_nnx_annotation_off_the_mesh_is_an_error_naming_the_variable(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=2)
    with jax.set_mesh(jax.sharding.Mesh(np.array(cpu_devices[:4]).reshape(2, 2), ("data", "tensor"))):
        model = nnx.Linear(
            8,
            6,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "tensor")),
            rngs=nnx.Rngs(0),
        )
    with pytest.raises(
        ValueError,
        match=r"the Flax Variable '0/0/kernel' is annotated \(None, 'tensor'\), naming 'tensor'.*"
        r"nnx.logical_axis_rules",
    ):
        strategy.put(model)


def test_the_mesh_and_the_variables_sharding(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=2)
    assert strategy.mesh.axis_names == ("replica", "shard") and dict(strategy.mesh.shape) == {
        "replica": 2,
        "shard": 2,
    }
    assert set(strategy.mesh.axis_types) == {jax.sharding.AxisType.Auto}
    assert strategy.sharding == NamedSharding(strategy.mesh, P())
    assert strategy.num_replicas_in_sync == 2 and strategy.devices_per_replica == 2
    assert strategy == ShardedStrategy(cpu_devices[:4], num_replicas=2)
    assert strategy != ShardedStrategy(cpu_devices[:4], num_replicas=4)


def test_scope_sets_no_mesh(cpu_devices):
    # Arrays made in scope land on the first device, as on MirroredStrategy, not on the mesh.
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=1)
    with strategy.scope():
        assert jax.sharding.get_abstract_mesh().empty
        assert jnp.zeros(3).devices() == {cpu_devices[0]}


def test_one_device_per_replica_trains_as_mirrored_strategy(cpu_devices):
    optimizer = optax.sgd(0.5, momentum=0.9)
    mirrored = jaxstrategy.MirroredStrategy(cpu_devices[:4])
    sharded = ShardedStrategy(cpu_devices[:4], num_replicas=4, min_shard_bytes=0)
    losses, params, _ = _sharded_training(sharded, optimizer)
    expected_losses, expected_params, _ = _sharded_training(mirrored, optimizer)
    np.testing.assert_array_equal(losses, expected_losses)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, expected_params))


def test_a_rule_clash_names_the_call_that_met_it(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], layout=[(".*kernel", P()), ("dense1/.*", P())])
    with pytest.raises(
        ValueError, match=r"^ShardedStrategy\.put\(\): the leaf 'dense1/kernel' matches more than one"
    ):
        strategy.put(_mlp_params())


# --- what a review found ----------------------------------------------------------------------


def test_arrays_committed_elsewhere_are_moved_on_every_call(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=2, min_shard_bytes=0)
    on_one_device = jax.device_put(_mlp_params(), cpu_devices[0])
    from_mirrored = jaxstrategy.MirroredStrategy(cpu_devices[:2]).put(_mlp_params())
    x = np.ones((4, 12), np.float32)

    def step(params, x):
        return jax.tree.map(lambda p: p * 2, params), x.sum()

    for params in (on_one_device, on_one_device, from_mirrored, strategy.put(_mlp_params()), on_one_device):
        doubled, _ = strategy.run(step, args=(params, x))
        np.testing.assert_array_equal(
            np.asarray(doubled["dense1"]["kernel"]), _mlp_params()["dense1"]["kernel"] * 2
        )
        assert_tree_on_strategy(doubled, strategy)


def test_values_from_a_function_may_be_prng_keys(sharded_on_every_shape):
    strategy = sharded_on_every_shape
    keys = strategy.experimental_distribute_values_from_function(
        lambda context: jax.random.fold_in(jax.random.key(0), context.replica_id_in_sync_group)
    )
    for i, key in enumerate(strategy.experimental_local_results(keys)):
        expected = jax.random.key_data(jax.random.fold_in(jax.random.key(0), i))
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(key)), np.asarray(expected))
        assert key.devices() == set(
            strategy.devices[i * strategy.devices_per_replica : (i + 1) * strategy.devices_per_replica]
        )


def test_init_names_itself_in_layout_errors(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], layout=[("bias", P("shard"))], min_shard_bytes=0)
    with pytest.raises(
        ValueError,
        match=r"^ShardedStrategy\.init\(\): the layout .* from rule 'bias' splits dimension 0 \(of size 10\)",
    ):
        strategy.init(lambda: {"bias": jnp.zeros(10)})


def test_a_compiled_regex_keeps_its_flags(cpu_devices):
    import re

    strategy = ShardedStrategy(
        cpu_devices[:4], layout=[(re.compile("DENSE1/KERNEL", re.IGNORECASE), P(None, "shard"))]
    )
    (row,) = [row for row in strategy.describe_layout(_mlp_params()).rows if row.path == "dense1/kernel"]
    assert row.reason == "rule 'DENSE1/KERNEL'" and row.spec == P(None, "shard")


def test_sizes_are_those_of_what_the_devices_hold(cpu_devices):
    # A float64 numpy leaf is stored as float32 (64-bit types off): 192 KiB, under the default
    # 256 KiB, whatever its host size (384 KiB).
    strategy = ShardedStrategy(cpu_devices[:4])
    host = np.zeros((256, 192))
    assert strategy.layout_of(host).spec == P()
    assert strategy.put(host).sharding.spec == strategy.init(lambda: jnp.zeros((256, 192))).sharding.spec
    (row,) = strategy.describe_layout({"w": host}).rows
    assert row.dtype == np.float32 and row.bytes_per_device == 256 * 192 * 4


def test_equal_specs_written_two_ways_make_equal_strategies(cpu_devices):
    assert ShardedStrategy(cpu_devices[:4], layout=[("w", P())]) == ShardedStrategy(
        cpu_devices[:4], layout=[("w", P(None))]
    )
