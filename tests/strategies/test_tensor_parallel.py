"""ShardedStrategy's 'model' axis: the conformance suite on a mesh ('replica', 'shard', 'model'), a
Megatron-style MLP against a plain `jax.jit` loop on one device, and `with_sharding_constraint`."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import StrategyConformance
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxstrategy
from jaxstrategy import ShardedStrategy

sys.path.insert(0, str(Path(__file__).parent))
import sharded_job_worker as worker  # noqa: E402

# (replicas, shards, model): a replica of one 'shard' device pair split on 'model', and two.
SHAPES = [(1, 2, 2), (2, 1, 2)]
# Megatron's split: the first kernel's output dimension and the second's input dimension.
MEGATRON = worker.MEGATRON

pytestmark = pytest.mark.filterwarnings("ignore:.*no dimension of it divides:UserWarning")


def _ids(shape: tuple[int, int, int]) -> str:
    return "R{}xS{}xM{}".format(*shape)


@pytest.fixture(params=SHAPES, ids=_ids)
def tensor_parallel(request, cpu_devices):
    replicas, _, model = request.param
    return ShardedStrategy(cpu_devices[:4], num_replicas=replicas, model_parallel=model, min_shard_bytes=64)


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, tensor_parallel):
        return tensor_parallel


def _params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {
        "w1": (rng.normal(size=(6, 16)) * 0.4).astype(np.float32),
        "b1": rng.normal(size=16).astype(np.float32),
        "w2": (rng.normal(size=(16, 3)) * 0.4).astype(np.float32),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_a_megatron_mlp_trains_as_on_one_device(cpu_devices, shape):
    # SGD with momentum and clipping by the global norm, each replica its own examples:
    # sharded_job_worker's training, which a job of two processes runs too.
    replicas, shards, model = shape
    strategy = ShardedStrategy(
        cpu_devices[:4], num_replicas=replicas, model_parallel=model, layout=MEGATRON, min_shard_bytes=0
    )
    assert strategy.mesh.shape == {"replica": replicas, "shard": shards, "model": model}
    training = worker.train(strategy)
    expected_losses, expected = worker.one_device_training()
    np.testing.assert_allclose(training["losses"], expected_losses, rtol=1e-5)
    for name in expected:
        np.testing.assert_allclose(training["params"][name], expected[name], atol=1e-6, err_msg=name)
    # Each kernel stays split on 'model', its momentum with it: half of it on each device.
    assert training["specs"]["w1"] == "(None, 'model')"
    assert training["momentum_specs"]["w2"] == "('model',)"
    assert training["w1_shard_shapes"] == [[8, 8]]


def _inspected_spec(strategy, constrain):
    """The spec XLA gave the hidden activation inside `run` (compile time)."""
    seen = []

    def fn(x, w):
        hidden = constrain(x @ w)
        jax.debug.inspect_array_sharding(hidden, callback=lambda sharding: seen.append(sharding.spec))
        return jnp.sum(hidden)

    strategy.run(fn, args=(jnp.ones((4, 6)), jnp.ones((6, 8))))
    return seen[0]


def test_with_sharding_constraint_lays_out_an_activation_on_the_model_axis(cpu_devices):
    for replicas in (1, 2):  # Bound by a vmap of one replica, and by the shard_map.
        strategy = ShardedStrategy(cpu_devices[:4], num_replicas=replicas, model_parallel=2)
        constrained = _inspected_spec(
            strategy, lambda h: jaxstrategy.with_sharding_constraint(h, (None, "model"))
        )
        assert "model" in str(constrained), constrained
        assert "model" not in str(_inspected_spec(strategy, lambda h: h))


def test_with_sharding_constraint_is_the_identity_without_those_axes(cpu_devices):
    x = jnp.arange(6.0).reshape(2, 3)
    for strategy in (
        jaxstrategy.OneDeviceStrategy(cpu_devices[0]),
        jaxstrategy.MirroredStrategy(cpu_devices[:2]),
    ):
        with strategy.scope():
            assert jaxstrategy.with_sharding_constraint(x, P(None, "model")) is x
    # No 'model' axis: its entries are dropped, 'shard' stays.
    strategy = ShardedStrategy(cpu_devices[:2])
    with strategy.scope():
        laid_out = jaxstrategy.with_sharding_constraint(jnp.ones((4, 6)), (("shard", "model"), None))
    assert laid_out.sharding.spec == P("shard", None)


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (P("replica"), ValueError, r"names 'replica'; .* split over 'shard' and 'model' only"),
        ((None, "data"), ValueError, r"names 'data'"),
        (("model", "model"), ValueError, r"names 'model' more than once"),
        ("model", TypeError, r"must be a PartitionSpec \(or a tuple of its entries\); got 'model'"),
    ],
)
def test_with_sharding_constraint_refuses_a_spec_over_other_axes(cpu_devices, spec, error, message):
    with pytest.raises(error, match=r"jaxstrategy.with_sharding_constraint\(\): .*" + message):
        jaxstrategy.with_sharding_constraint(jnp.ones((2, 2)), spec)


def test_a_layout_for_the_model_axis_serves_a_strategy_without_one(cpu_devices):
    with_model = ShardedStrategy(cpu_devices[:4], model_parallel=2, layout=MEGATRON, min_shard_bytes=0)
    without = ShardedStrategy(cpu_devices[:4], layout=MEGATRON, min_shard_bytes=0)
    params = _params()
    assert with_model.layout_of(params)["w1"].spec == P(None, "model")
    assert without.mesh.axis_names == ("replica", "shard")
    # A rule that names 'model' alone decides nothing there: the default splits the leaf over
    # 'shard' rather than leave it whole on every device.
    rows = {row.path: row for row in without.describe_layout(params).rows}
    assert rows["w1"].spec == P(None, "shard")
    assert rows["w1"].reason == (
        "default: largest dimension 4 divides (rule 'w1' names only 'model', an axis of 1 here)"
    )
    both = ShardedStrategy(cpu_devices[:2], layout=[("w1", P("shard", "model"))], min_shard_bytes=0)
    assert both.layout_of(params)["w1"].spec == P("shard", None)  # 'shard' still splits it.


def test_sizes_count_both_axes(cpu_devices):
    strategy = ShardedStrategy(
        cpu_devices[:4], model_parallel=2, layout=[("w1", P(None, ("shard", "model")))], min_shard_bytes=0
    )
    rows = {row.path: row for row in strategy.describe_layout(_params()).rows}
    assert rows["w1"].bytes_per_device == 6 * 16 * 4 // 4
    assert rows["w2"].reason.startswith("default") and rows["w2"].spec == P("shard", None)
    assert rows["w2"].bytes_per_device == 16 * 3 * 4 // 2
    assert strategy.devices_per_replica == 4 and strategy.model_parallel == 2


def test_a_split_that_both_axes_together_do_not_divide_is_an_error(cpu_devices):
    strategy = ShardedStrategy(
        cpu_devices[:4], model_parallel=2, layout=[("b1", P(("shard", "model")))], min_shard_bytes=0
    )
    with pytest.raises(ValueError, match=r"splits dimension 0 \(of size 6\) of the leaf 'b1' over 4 devices"):
        strategy.put({"b1": np.zeros(6, np.float32)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"model_parallel": 3},
            r"model_parallel=3 does not divide the 4 devices of each replica .* among \[1, 2, 4\]",
        ),
        (
            {"num_replicas": 2, "model_parallel": 4},
            r"model_parallel=4 does not divide the 2 devices of each replica .* among \[1, 2\]",
        ),
        ({"model_parallel": 0}, r"model_parallel must be a positive int; got 0"),
        ({"model_parallel": True}, r"model_parallel must be a positive int; got True"),
    ],
)
def test_model_parallel_must_divide_a_replica_s_devices(cpu_devices, kwargs, message):
    with pytest.raises(ValueError, match=r"ShardedStrategy\(\): " + message):
        ShardedStrategy(cpu_devices[:4], **kwargs)


def test_strategies_differing_in_model_parallel_differ(cpu_devices):
    one, two = (ShardedStrategy(cpu_devices[:4], model_parallel=m) for m in (1, 2))
    assert one != two and one == ShardedStrategy(cpu_devices[:4])
    assert "model_parallel=2" in repr(two)


def _annotated_linear(names):
    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
    return nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))


def test_an_nnx_model_annotated_for_the_model_axis_is_split_over_shard_without_one(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], num_replicas=2, min_shard_bytes=0)
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules([("embed", None), ("mlp", "model")]):
        model = strategy.init(lambda: _annotated_linear(("embed", "mlp")))
        (row,) = [row for row in strategy.describe_layout(model).rows if row.path.endswith("kernel")]
    assert model.kernel[...].sharding.spec == P(None, "shard")
    assert row.reason.endswith("(Flax Variable annotation names only 'model', an axis of 1 here)")


def test_two_logical_names_on_one_axis_are_an_error_naming_the_variable(cpu_devices):
    strategy = ShardedStrategy(cpu_devices[:4], model_parallel=2)
    with nnx.use_eager_sharding(False), nnx.logical_axis_rules([("heads", "model"), ("mlp", "model")]):
        model = _annotated_linear(("heads", "mlp"))
        with pytest.raises(
            ValueError,
            match=r"ShardedStrategy.put\(\): the spec P\('model', 'model'\) of the Flax Variable "
            r"'0/0/kernel' names 'model' more than once",
        ):
            strategy.put(model)
