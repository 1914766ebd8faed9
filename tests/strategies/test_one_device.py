"""OneDeviceStrategy: the shared conformance suite, plus the rows of docs/semantics.md for one device."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import StrategyConformance

import jaxstrategy
from jaxstrategy import OneDeviceStrategy, ReduceOp


@pytest.fixture(params=["/cpu:0", "/cpu:1"])
def one_device_on_cpu0_and_cpu1(request):
    """Both JAX's default device and another one, so that misplacement shows."""
    return OneDeviceStrategy(request.param)


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, one_device_on_cpu0_and_cpu1):
        return one_device_on_cpu0_and_cpu1


# --- construction ------------------------------------------------------------------------------


def test_no_device_means_the_default_device():
    assert OneDeviceStrategy().device == jax.devices()[0]


def test_spec_device_forms_and_canonical_names(cpu_devices):
    strategy = OneDeviceStrategy(device="/cpu:1")
    assert strategy.device == cpu_devices[1]
    assert strategy.devices == (cpu_devices[1],)
    assert strategy.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:1",)


def test_attributes():
    strategy = OneDeviceStrategy("/cpu:0")
    assert strategy.num_replicas_in_sync == 1
    assert strategy.sharding == jax.sharding.SingleDeviceSharding(strategy.device)
    assert strategy.mesh.axis_names == ("replica",)
    assert strategy.mesh.devices.tolist() == [strategy.device]
    assert strategy.extended.experimental_should_init is True
    assert strategy.extended.experimental_require_static_shapes is False
    # One process: it is the chief, and one program drives its device.
    assert (strategy.extended.should_checkpoint, strategy.extended.should_save_summary) == (True, True)
    assert strategy.extended.experimental_between_graph is False
    assert strategy.cluster_resolver is None


def test_repr_reads_like_the_constructor_call():
    assert repr(OneDeviceStrategy("/cpu:0")) == "OneDeviceStrategy(device=CpuDevice(id=0))"


def test_strategies_on_the_same_device_are_equal():
    assert OneDeviceStrategy("/cpu:0") == OneDeviceStrategy("CPU:0")
    assert hash(OneDeviceStrategy("/cpu:0")) == hash(OneDeviceStrategy(0))
    assert OneDeviceStrategy("/cpu:0") != OneDeviceStrategy("/cpu:1")


def test_missing_device_is_an_error_naming_the_devices():
    with pytest.raises(
        ValueError, match=r"OneDeviceStrategy\(device='/gpu:0'\): no such device; this process sees \["
    ):
        OneDeviceStrategy("/gpu:0")


def test_soft_placement_falls_back_with_one_warning():
    with pytest.warns(
        UserWarning, match=r"no such device.*soft_placement=True, so it uses the default device"
    ) as record:
        strategy = OneDeviceStrategy("/cpu:99", soft_placement=True)
    assert len(record) == 1
    assert strategy.device == jax.devices()[0]


# --- scope -------------------------------------------------------------------------------------


def test_mixing_strategies_names_both(strategy_cpu1):
    other = OneDeviceStrategy("/cpu:0")
    expected = (
        r"Mixing different Strategy objects: scope\(\) was called on OneDeviceStrategy\(device=CpuDevice\(id=0\)\) "
        r"inside the scope of OneDeviceStrategy\(device=CpuDevice\(id=1\)\)"
    )
    with strategy_cpu1.scope():
        with pytest.raises(jaxstrategy.StrategyContextError, match=expected):
            with other.scope():
                pass
        with pytest.raises(
            RuntimeError, match=r"Mixing different Strategy objects: OneDeviceStrategy.run\(\)"
        ):
            other.run(lambda x: x, args=(1,))
        with pytest.raises(
            RuntimeError, match=r"Mixing different Strategy objects: OneDeviceStrategy.reduce\(\)"
        ):
            other.reduce("sum", 1, axis=None)


def test_an_equal_strategy_shares_the_scope():
    with OneDeviceStrategy("/cpu:1").scope():
        with OneDeviceStrategy("cpu:1").scope():
            assert jaxstrategy.get_strategy() == OneDeviceStrategy("/cpu:1")


def test_spec_variable_in_scope_lands_on_the_device(strategy_cpu1):
    with strategy_cpu1.scope():
        v = strategy_cpu1.put(1.0)
        made_by_jax = jnp.asarray(1.0)
    assert v.devices() == {strategy_cpu1.device} and v.committed
    assert made_by_jax.devices() == {strategy_cpu1.device}


# --- run ---------------------------------------------------------------------------------------


def test_run_copies_arrays_committed_to_another_device(strategy_cpu1, cpu_devices):
    elsewhere = jax.device_put(jnp.arange(3.0), cpu_devices[0])
    out = strategy_cpu1.run(lambda x: x + 1, args=(elsewhere,))
    assert out.devices() == {strategy_cpu1.device} and out.committed
    assert out.tolist() == [1.0, 2.0, 3.0]


def test_run_returns_arrays_where_tensorflow_returns_python_values():
    out = OneDeviceStrategy().run(lambda x: x * 2, args=(3.5,))
    assert isinstance(out, jax.Array) and out.tolist() == 7.0


# --- reduce, gather, local results, values -----------------------------------------------------


@pytest.mark.parametrize("value", [jnp.arange(10), 5, {"a": np.ones(2), "b": "text"}, None], ids=repr)
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN])
def test_reduce_with_axis_none_returns_the_value_itself(value, op):
    assert OneDeviceStrategy().reduce(op, value, axis=None) is value


def test_reduce_spec_example():
    strategy = OneDeviceStrategy()
    t = jnp.arange(10)
    assert strategy.reduce(ReduceOp.SUM, t, axis=None).tolist() == list(range(10))
    assert strategy.reduce(ReduceOp.SUM, t, axis=0).tolist() == 45


def test_reduce_result_is_committed_to_the_strategy(strategy_cpu1, cpu_devices):
    value = jax.device_put(jnp.arange(4.0), cpu_devices[0])
    for op in ("sum", "mean"):
        result = strategy_cpu1.reduce(op, value, axis=0)
        assert result.devices() == {strategy_cpu1.device} and result.committed


def test_reduce_with_an_axis_rejects_leaves_that_are_not_arrays():
    with pytest.raises(
        TypeError, match=r"every leaf must be an array to reduce along an axis:\n  value\['b'\] is a str"
    ):
        OneDeviceStrategy().reduce("sum", {"a": np.ones(2), "b": "text"}, axis=0)


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_gather_spec_example_returns_the_value_unchanged(axis):
    single_tensor = jnp.arange(6).reshape(1, 2, 3)
    assert OneDeviceStrategy().gather(single_tensor, axis=axis) is single_tensor


@pytest.mark.parametrize("axis", [(0, 1), True, 1.0])
def test_gather_rejects_an_axis_that_is_not_an_int(axis):
    with pytest.raises(TypeError, match=rf"gather\(\): axis must be an int; got {re.escape(repr(axis))}"):
        OneDeviceStrategy().gather(jnp.ones((2, 2)), axis=axis)


@pytest.mark.parametrize("value", [jnp.ones(2), {"a": 1, "b": (2, 3.0)}, (1, 2), 5, None], ids=repr)
def test_local_results_is_always_a_one_tuple(value):
    assert OneDeviceStrategy().experimental_local_results(value) == (value,)


def test_values_from_function_places_array_leaves_and_keeps_the_rest(strategy_cpu1):
    value = strategy_cpu1.experimental_distribute_values_from_function(
        lambda context: {"id": context.replica_id_in_sync_group, "x": np.ones(2), "name": "replica"}
    )
    assert value["name"] == "replica"
    for leaf in (value["id"], value["x"]):
        assert leaf.devices() == {strategy_cpu1.device} and leaf.committed
    assert value["id"].tolist() == 0


def test_spec_values_from_function_examples():
    strategy = OneDeviceStrategy()
    array_value = np.array([3.0, 2.0, 1.0])
    examples = {
        "constant": lambda _: jnp.float32(1.0),
        "by replica id": lambda context: array_value[context.replica_id_in_sync_group],
        "replica count": lambda context: context.num_replicas_in_sync,
    }
    results = {
        name: [
            v.tolist()
            for v in strategy.experimental_local_results(
                strategy.experimental_distribute_values_from_function(fn)
            )
        ]
        for name, fn in examples.items()
    }
    assert results == {"constant": [1.0], "by replica id": [3.0], "replica count": [1]}


# --- replica context on one device -------------------------------------------------------------


def test_all_reduce_on_one_replica_keeps_values_and_gives_mean_a_float():
    def step(x):
        context = jaxstrategy.get_replica_context()
        return {
            "sum": context.all_reduce("sum", x),
            "mean": context.all_reduce("mean", x),
            "nested": context.all_reduce("sum", {"a": (x, 2.5)}),
        }

    out = OneDeviceStrategy().run(step, args=(jnp.int32(3),))
    assert (out["sum"].tolist(), out["sum"].dtype) == (3, jnp.int32)
    assert (out["mean"].tolist(), out["mean"].dtype) == (3.0, jnp.float32)
    assert out["nested"]["a"][1].tolist() == 2.5


def test_all_reduce_rejects_leaves_that_are_not_arrays():
    def step(x):
        return jaxstrategy.get_replica_context().all_reduce("sum", {"x": x, "name": "loss"})

    with pytest.raises(
        TypeError, match=r"all_reduce\(\): every leaf must be an array:\n  value\['name'\] is a str"
    ):
        OneDeviceStrategy().run(step, args=(1.0,))


def test_replica_context_devices():
    seen = []
    strategy = OneDeviceStrategy("/cpu:1")
    strategy.run(lambda x: seen.append(jaxstrategy.get_replica_context().devices) or x, args=(1,))
    assert seen == [(strategy.device,)]


def test_merge_call_is_refused_as_on_many_replicas(one_device_on_cpu0_and_cpu1):
    # docs/semantics.md: OneDeviceStrategy rejects what MirroredStrategy would reject.
    called = []

    def step(x):
        return jaxstrategy.get_replica_context().merge_call(lambda s, v: called.append(v), args=(x,))

    with pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported.*all_reduce"):
        one_device_on_cpu0_and_cpu1.run(step, args=(1,))
    assert called == []


def test_merge_call_rejects_a_non_callable():
    def step(x):
        return jaxstrategy.get_replica_context().merge_call(3)

    with pytest.raises(TypeError, match=r"merge_fn must be callable; got 3"):
        OneDeviceStrategy().run(step, args=(1,))


def test_no_warnings_in_a_plain_training_loop():
    strategy = OneDeviceStrategy()
    params = strategy.put({"w": np.ones(3, np.float32)})

    def step(params, x):
        return jax.tree.map(lambda p: p - 0.1 * x, params)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(5):
            params = strategy.run(step, args=(params, np.float32(i)))
    np.testing.assert_allclose(params["w"], 1 - 0.1 * sum(range(5)), atol=1e-6)


# --- the replica axis, of size 1 (issue 28, item 2) --------------------------------------------


def test_code_written_for_many_devices_names_the_replica_axis_here_too():
    strategy = jaxstrategy.OneDeviceStrategy()
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(
        np.asarray(strategy.run(lambda x: jax.lax.psum(x, "replica"), args=(x,))), x
    )
    np.testing.assert_array_equal(
        np.asarray(strategy.run(lambda x: jax.lax.pmean(x, "replica"), args=(x,))), x
    )
    assert int(strategy.run(lambda: jax.lax.axis_index("replica"))) == 0
    gathered = strategy.run(lambda x: jax.lax.all_gather(x, "replica"), args=(x,))
    assert gathered.shape == (1, 3)


def test_batch_norm_over_the_replica_axis_runs_on_one_device():
    from flax import nnx

    strategy = jaxstrategy.OneDeviceStrategy()
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    across = strategy.put(nnx.BatchNorm(3, axis_name="replica", rngs=nnx.Rngs(0)))
    plain = nnx.BatchNorm(3, rngs=nnx.Rngs(0))
    out = strategy.run(lambda model, x: model(x), args=(across, data))
    np.testing.assert_allclose(np.asarray(out), np.asarray(plain(jnp.asarray(data))), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(across.mean[...]), np.asarray(plain.mean[...]), rtol=1e-6)


def test_python_control_flow_on_a_traced_flag_says_how_to_make_it_static():
    # Issue 28, item 5: JAX's own error pointed into the library and said nothing of run's options.
    strategy = jaxstrategy.OneDeviceStrategy()

    def step(x, training):
        return x * 2 if training else x

    with pytest.raises(jax.errors.TracerBoolConversionError) as raised:
        strategy.run(step, args=(jnp.ones(2), True))
    note = "\n".join(raised.value.__notes__)
    assert "OneDeviceStrategy.run(): fn is compiled once" in note
    assert "RunOptions(static_argnums=...)" in note and "a string or an enum member" in note
    static = strategy.run(step, args=(jnp.ones(2), True), options=jaxstrategy.RunOptions(static_argnums=(1,)))
    assert static.tolist() == [2.0, 2.0]
