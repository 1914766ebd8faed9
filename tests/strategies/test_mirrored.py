"""MirroredStrategy: the shared conformance suite on 1, 2 and 4 devices, plus the rows of
docs/semantics.md's MirroredStrategy section."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance import StrategyConformance
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxstrategy
from jaxstrategy import InputOptions, MirroredStrategy, OneDeviceStrategy, PerReplica, ReduceOp
from jaxstrategy.testing import assert_tree_on_strategy

_COMPILES: collections.Counter[str] = collections.Counter()


def _count_compiles(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _COMPILES["backend"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compiles)


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"{n}-devices")
def mirrored_on_1_2_and_4_devices(request, cpu_devices):
    return MirroredStrategy(cpu_devices[: request.param])


@pytest.fixture
def two(cpu_devices):
    """TensorFlow's recorded MirroredStrategy(['/cpu:0', '/cpu:1'])."""
    return MirroredStrategy(["/cpu:0", "/cpu:1"])


@pytest.fixture
def four(cpu_devices):
    return MirroredStrategy()


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, mirrored_on_1_2_and_4_devices):
        return mirrored_on_1_2_and_4_devices


def _per_replica(strategy, values):
    """A PerReplica whose replica i holds values[i]."""
    return strategy.experimental_distribute_values_from_function(
        lambda context: jnp.asarray(values[context.replica_id_in_sync_group])
    )


def _local(strategy, value):
    return [np.asarray(v).tolist() for v in strategy.experimental_local_results(value)]


# --- construction ------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", [None, [], ()], ids=repr)
def test_no_devices_means_every_local_device(devices, cpu_devices):
    strategy = MirroredStrategy(devices)
    assert strategy.devices == tuple(cpu_devices)
    assert strategy.num_replicas_in_sync == len(cpu_devices)


def test_device_forms_mesh_and_tensorflow_names(cpu_devices):
    strategy = MirroredStrategy(["/cpu:0", cpu_devices[1], "/job:localhost/replica:0/task:0/device:CPU:2"])
    assert strategy.devices == tuple(cpu_devices[:3])
    assert strategy.extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3)
    )
    assert strategy.mesh.axis_names == ("replica",)
    assert strategy.mesh.devices.tolist() == list(cpu_devices[:3])
    # Auto axes: jax.make_mesh's Explicit axes would make shard_map reject unsharded inputs.
    assert all(t == jax.sharding.AxisType.Auto for t in strategy.mesh.axis_types)
    assert strategy.sharding == jax.NamedSharding(strategy.mesh, jax.P())


def test_two_device_attributes_match_tensorflow(two):
    assert two.num_replicas_in_sync == 2
    assert two.extended.worker_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:0",
        "/job:localhost/replica:0/task:0/device:CPU:1",
    )
    assert two.cluster_resolver is None
    assert (two.extended.should_checkpoint, two.extended.should_save_summary) == (True, True)
    assert two.extended.experimental_between_graph is False


def test_repr_equality_and_hash(cpu_devices):
    strategy = MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert repr(strategy) == "MirroredStrategy(devices=(CpuDevice(id=0), CpuDevice(id=1)))"
    assert strategy == MirroredStrategy(cpu_devices[:2]) and hash(strategy) == hash(
        MirroredStrategy(cpu_devices[:2])
    )
    assert strategy != MirroredStrategy(["/cpu:1", "/cpu:0"])
    assert strategy != OneDeviceStrategy("/cpu:0")


def test_duplicate_devices_are_an_error():
    with pytest.raises(jaxstrategy.InvalidDeviceError, match=r"CpuDevice\(id=0\) is listed more than once"):
        MirroredStrategy(["/cpu:0", "CPU:0"])


def test_none_in_the_list_is_an_error_not_the_default_device():
    # As TensorFlow, an empty list means every local device; None in a list names no device.
    with pytest.raises(
        TypeError, match=r"devices\[1\] is None, which names no device.*devices=None for every local device"
    ):
        MirroredStrategy(["/cpu:0", None])


def test_a_bare_string_is_an_error_not_iterated_per_character():
    with pytest.raises(TypeError, match=r"devices='/cpu:0'\): expected a list or tuple .* got a str"):
        MirroredStrategy("/cpu:0")  # type: ignore[arg-type]


def test_a_missing_device_names_its_position_and_the_devices_there_are():
    with pytest.raises(
        jaxstrategy.InvalidDeviceError,
        match=r"devices\[1\]='/cpu:9'\): no such device; this process sees \[Cpu",
    ):
        MirroredStrategy(["/cpu:0", "/cpu:9"])


def test_a_malformed_device_names_its_position():
    with pytest.raises(jaxstrategy.InvalidDeviceError, match=r"devices\[0\]='bogus'\): cannot parse"):
        MirroredStrategy(["bogus"])


def test_cross_device_ops_has_no_effect_and_warns():
    with pytest.warns(UserWarning, match=r"cross_device_ops=...\) has no effect: XLA chooses"):
        MirroredStrategy(["/cpu:0"], cross_device_ops=object())


def test_mixing_with_another_strategy_names_both(two):
    one = OneDeviceStrategy("/cpu:0")
    with (
        two.scope(),
        pytest.raises(
            jaxstrategy.StrategyContextError,
            match=r"called on OneDeviceStrategy.* inside the scope of MirroredStrategy",
        ),
    ):
        one.run(lambda x: x, args=(1,))


# --- run ---------------------------------------------------------------------------------------


def test_run_gives_each_replica_its_component_and_others_the_whole_value(four):
    batch = _per_replica(four, [np.full(2, i, np.float32) for i in range(4)])
    seen_shapes = []

    def step(x, w):
        seen_shapes.append((x.shape, w.shape))
        return x * w[0]

    out = four.run(step, args=(batch, jnp.full(3, 10.0)))
    assert seen_shapes == [((2,), (3,))], "traced once, with one replica's block"
    assert isinstance(out, PerReplica)
    assert _local(four, out) == [[0.0, 0.0], [10.0, 10.0], [20.0, 20.0], [30.0, 30.0]]


def test_run_traces_once_and_compiles_once_for_many_steps(four):
    chex.clear_trace_counter()

    @chex.assert_max_traces(n=1)
    def step(x, i):
        return jaxstrategy.get_replica_context().all_reduce("sum", x * i)

    batches = [_per_replica(four, [np.float32(i + j) for i in range(4)]) for j in range(3)]
    four.run(step, args=(batches[0], 0))
    compiles_before = _COMPILES["backend"]
    for i in range(20):
        total = four.run(step, args=(batches[i % 3], i))
    assert float(total) == (6.0 + 4 * (19 % 3)) * 19
    assert _COMPILES["backend"] == compiles_before


def test_inputs_not_yet_on_the_mesh_do_not_trace_the_step_again(two):
    # JAX keys its trace cache on an input's mesh: state made with jnp.zeros and the same state
    # coming back from the first step on the mesh would trace twice unless run places it first.
    chex.clear_trace_counter()

    @chex.assert_max_traces(n=1)
    def step(state, x):
        return jax.tree.map(lambda s: s + jnp.sum(x), state)

    state = {"w": jnp.zeros(3), "b": jax.device_put(jnp.zeros(()), jax.devices()[3])}
    for i in range(4):
        state = two.run(step, args=(state, np.full(2, i, np.float32)))  # numpy: a new array each step
    assert state["w"].tolist() == [12.0] * 3
    assert_tree_on_strategy(state, two)


def test_a_compiled_step_never_runs_with_another_input_layout(two):
    # jit alone would take a PerReplica where a whole array was pinned (a sharding pinned for a
    # whole argument fits any subtree), copying every component to every device: each replica
    # would then see [1, 2] whole, and nothing would be traced again.
    traces = []

    def step(x):
        traces.append(x.shape)
        return x * 2

    whole = np.ones(2, np.float32)
    split = PerReplica(np.array([1.0, 2.0], np.float32))  # On the host: jit would place it anyhow.
    two.run(step, args=(whole,))
    assert _local(two, two.run(step, args=(split,))) == [2.0, 4.0]
    assert traces == [(2,), ()]  # Compiled again, for one element per replica.
    assert two.run(step, args=(whole,)).tolist() == [2.0, 2.0]
    assert len(traces) == 2


def test_run_inside_an_outer_jit(two):
    outer = jax.jit(lambda x: two.run(lambda y: y + 1, args=(x,)))
    assert outer(jnp.ones(2)).tolist() == [2.0, 2.0]


def test_a_per_replica_with_the_wrong_number_of_components_is_an_error(two, four):
    from_four = _per_replica(four, [0.0, 1.0, 2.0, 3.0])
    message = r"has 2 replica\(s\), so a PerReplica must have one component per replica.*\n  {} has 4"
    with pytest.raises(ValueError, match=message.format(re.escape("args[0]['x']"))):
        two.run(lambda batch: batch["x"], args=({"x": from_four},))
    with pytest.raises(ValueError, match=message.format("value")):
        two.experimental_local_results(from_four)
    with pytest.raises(ValueError, match=message.format(re.escape("value['loss']"))):
        two.reduce("sum", {"loss": from_four}, axis=None)
    with pytest.raises(ValueError, match=message.format("value")):
        two.gather(from_four, axis=0)
    with pytest.raises(ValueError, match=message.format(re.escape("tree[0]"))):
        two.put([from_four])
    for scalar in (jnp.float32(1.0), 1.0):
        with pytest.raises(ValueError, match=r"args\[0\] holds a scalar, with no axis of components"):
            two.run(lambda x: x, args=(PerReplica(scalar),))


def test_a_per_replica_that_the_replicas_divide_is_still_checked_once_compiled(two):
    # Once compiled for two components, jit would take four (two per replica) without a word.
    step = lambda x: x * 2  # noqa: E731
    two.run(step, args=(_per_replica(two, [1.0, 2.0]),))
    four_components = PerReplica(jax.device_put(jnp.arange(4.0), NamedSharding(two.mesh, P("replica"))))
    with pytest.raises(ValueError, match=r"args\[0\] has 4 component\(s\)"):
        two.run(step, args=(four_components,))


def test_put_keeps_a_per_replica_split_over_the_replicas(two):
    value = _per_replica(two, [1.0, 2.0])
    placed = two.put({"v": value, "w": 3.0})
    assert isinstance(placed["v"], PerReplica)
    assert placed["v"].stacked.sharding.spec == jax.sharding.PartitionSpec("replica")
    assert _local(two, placed["v"]) == [1.0, 2.0]
    assert [v.devices() for v in placed["v"].values] == [{d} for d in two.devices]


def test_components_of_a_stacked_array_laid_out_otherwise_are_its_rows(two):
    replicated = PerReplica(two.put(jnp.arange(2.0)))  # Every device holds both rows.
    assert [float(v) for v in replicated.values] == [0.0, 1.0]
    assert _local(two, replicated) == [0.0, 1.0]
    assert [v.devices() for v in two.experimental_local_results(replicated)] == [{d} for d in two.devices]


def test_replica_ids_are_zero_and_one_on_two_devices(two):
    ids = two.run(lambda: jaxstrategy.get_replica_context().replica_id_in_sync_group)
    assert isinstance(ids, PerReplica)
    assert _local(two, ids) == [0, 1]


def test_tensorflow_all_reduce_rows(two):
    def step(x):
        context = jaxstrategy.get_replica_context()
        return context.all_reduce("sum", x), context.all_reduce("MEAN", x)

    values = _per_replica(two, [np.float32(1), np.float32(2)])
    total, mean = two.run(step, args=(values,))
    assert (float(total), float(mean)) == (3.0, 1.5)
    # JAX shows the results are the same everywhere, so they come back replicated, not PerReplica.
    assert_tree_on_strategy((total, mean), two)


def test_all_reduce_of_an_integer_mean_is_a_float(two):
    def step(x):
        return jaxstrategy.get_replica_context().all_reduce("mean", x)

    mean = two.run(step, args=(_per_replica(two, [np.int32(1), np.int32(2)]),))
    assert mean.dtype == jnp.float32 and float(mean) == 1.5


def test_all_gather_concatenates_in_replica_order(two):
    def step(x):
        return jaxstrategy.get_replica_context().all_gather(x, axis=0)

    gathered = two.run(step, args=(_per_replica(two, [np.zeros((1, 2, 3)), np.ones((1, 2, 3))]),))
    # The same on every replica, so one replicated array, as an all_reduce result is.
    assert not isinstance(gathered, PerReplica) and gathered.sharding == two.sharding
    assert gathered.shape == (2, 2, 3)
    assert np.asarray(gathered)[:, 0, 0].tolist() == [0.0, 1.0]
    # Of a value every replica sees whole: its copies.
    whole = two.run(
        lambda x: jaxstrategy.get_replica_context().all_gather(x, axis=0), args=(jnp.arange(2.0),)
    )
    assert whole.tolist() == [0.0, 1.0, 0.0, 1.0]


def test_gradients_through_all_gather_sum_every_replica_s_upstream_gradient(two):
    # As TensorFlow: each replica's loss sum(all_gather(x)**2) holds every block, so each block's
    # gradient is the sum over the 2 replicas of 2x: 4x.
    def step(x):
        context = jaxstrategy.get_replica_context()
        return jax.grad(lambda x: jnp.sum(context.all_gather(x, axis=0) ** 2))(x)

    grads = two.run(step, args=(_per_replica(two, [np.float32([1.0, 2.0]), np.float32([3.0, 4.0])]),))
    assert _local(two, grads) == [[4.0, 8.0], [12.0, 16.0]]


def test_outputs_are_per_replica_only_where_they_can_differ(four):
    params = four.put({"w": np.float32(2)})
    batch = _per_replica(four, [np.float32(i) for i in range(4)])

    def step(params, x):
        context = jaxstrategy.get_replica_context()
        return {
            "per_example": x * params["w"],
            "summed": context.all_reduce("sum", x),
            "from_params_only": params["w"] + 1,
        }

    out = four.run(step, args=(params, batch))
    assert isinstance(out["per_example"], PerReplica)
    assert_tree_on_strategy({"summed": out["summed"], "from_params_only": out["from_params_only"]}, four)
    assert (float(out["summed"]), float(out["from_params_only"])) == (6.0, 3.0)


def test_merge_call_is_not_supported_and_says_what_to_use(two):
    def step(x):
        return jaxstrategy.get_replica_context().merge_call(lambda strategy, v: v, args=(x,))

    with pytest.raises(
        NotImplementedError,
        match=r"merge_call\(\) is not supported: the replicas run as one SPMD program.*all_reduce",
    ):
        two.run(step, args=(1.0,))


def test_run_copies_arrays_committed_to_other_devices(two, cpu_devices):
    elsewhere = jax.device_put(jnp.ones(3), cpu_devices[3])
    out = two.run(lambda x: x + 1, args=(elsewhere,))
    assert_tree_on_strategy(out, two)
    from_another_mesh = MirroredStrategy(["/cpu:2", "/cpu:3"]).put(jnp.ones(2))
    assert_tree_on_strategy(two.run(lambda x: x * 2, args=(from_another_mesh,)), two)
    with pytest.raises(ValueError, match="from the step itself"):
        two.run(_raise_value_error, args=(jnp.ones(2),))


def _raise_value_error(x):
    raise ValueError("from the step itself")


def test_run_with_static_arguments_kwargs_and_donation(two):
    def step(x, mode, *, scale):
        return x * scale if mode == "train" else x

    batch = _per_replica(two, [np.ones(2, np.float32), np.ones(2, np.float32)])
    out = two.run(step, args=(batch, "train"), kwargs={"scale": 3.0})
    assert _local(two, out) == [[3.0, 3.0], [3.0, 3.0]]
    state = two.put(jnp.zeros(4))
    options = jaxstrategy.RunOptions(donate_argnums=0)
    new_state = two.run(lambda s: s + 1, args=(state,), options=options)
    assert state.is_deleted() and new_state.tolist() == [1.0] * 4


def test_run_rejects_outputs_that_are_not_arrays(two):
    with pytest.raises(TypeError, match=r"must return a pytree of arrays, but:\n  output\['name'\] is a str"):
        two.run(lambda x: {"name": "loss", "x": x}, args=(1.0,))


# --- PerReplica --------------------------------------------------------------------------------


def test_per_replica_repr_reads_like_tensorflow(two):
    value = _per_replica(two, [np.int32(0), np.int32(1)])
    assert repr(value) == "PerReplica:{\n  0: Array(0, dtype=int32),\n  1: Array(1, dtype=int32)\n}"


def test_per_replica_has_no_arithmetic_and_explains_conversion(two):
    value = _per_replica(two, [np.float32(0), np.float32(1)])
    with pytest.raises(TypeError, match=r"unsupported operand"):
        value + 1  # noqa: B018
    with pytest.raises(TypeError, match=r"holds one value per replica.*experimental_local_results"):
        np.asarray(value)


def test_per_replica_is_a_pytree_of_one_stacked_array(two):
    value = _per_replica(two, [np.zeros(3, np.float32), np.ones(3, np.float32)])
    (stacked,) = jax.tree.leaves(value)
    assert stacked.shape == (2, 3) and stacked.sharding.spec == jax.P("replica")
    assert [v.devices() for v in value.values] == [{d} for d in two.devices]


# --- reduce, gather, local results -------------------------------------------------------------


def test_tensorflow_reduce_rows(two):
    value = _per_replica(two, [np.arange(3, dtype=np.int32), np.arange(10, 13, dtype=np.int32)])
    assert two.reduce("sum", value, axis=None).tolist() == [10, 12, 14]
    mean = two.reduce(ReduceOp.MEAN, value, axis=None)
    assert mean.tolist() == [5.0, 6.0, 7.0] and mean.dtype == jnp.float32  # TF: float64
    assert two.reduce("sum", value, axis=0).tolist() == 36
    assert two.reduce("mean", value, axis=0).tolist() == 6.0
    # A plain value stands for the same value on every replica (TF gives 90 here too).
    assert two.reduce("sum", jnp.arange(10), axis=0).tolist() == 90
    assert_tree_on_strategy(two.reduce("sum", value, axis=None), two)


def test_reduce_of_a_plain_value_across_replicas(two):
    # TensorFlow raises for SUM without an axis; here SUM counts the value once per replica.
    assert two.reduce("sum", jnp.int32(3), axis=None).tolist() == 6
    mean = two.reduce("mean", jnp.int32(3), axis=None)
    assert mean.tolist() == 3 and mean.dtype == jnp.int32


def test_reduce_checks_the_components_axes(two):
    value = _per_replica(two, [np.ones(3), np.ones(3)])
    with pytest.raises(ValueError, match=r"axis 1 is out of range for the value, which has rank 1"):
        two.reduce("sum", value, axis=1)


def test_reduce_of_a_leaf_that_is_not_an_array_names_it(two):
    with pytest.raises(TypeError, match=r"value\['name'\] is a str"):
        two.reduce("sum", {"name": "x"}, axis=None)


def test_tensorflow_gather_rows(two, four):
    value = _per_replica(two, [np.arange(3), np.arange(10, 13)])
    assert two.gather(value, axis=0).tolist() == [0, 1, 2, 10, 11, 12]
    spec = _per_replica(four, [np.arange(6).reshape(1, 2, 3)] * 4)
    assert [four.gather(spec, axis).shape for axis in (0, 1, 2, -1)] == [
        (4, 2, 3),
        (1, 8, 3),
        (1, 2, 12),
        (1, 2, 12),
    ]
    assert_tree_on_strategy(four.gather(spec, 1), four)
    with pytest.raises(ValueError, match=r"axis 1 is out of range .* rank 1"):
        two.gather(value, axis=1)


def test_gather_of_a_plain_value_concatenates_its_copies(two):
    assert two.gather(jnp.arange(2), axis=0).tolist() == [0, 1, 0, 1]


def test_local_results_of_each_kind_of_leaf(two):
    replicated = two.put(jnp.float32(7))
    out = two.run(
        lambda x: {"id": jaxstrategy.get_replica_context().replica_id_in_sync_group, "x": x},
        args=(replicated,),
    )
    local = two.experimental_local_results(out)
    assert [(int(r["id"]), float(r["x"])) for r in local] == [(0, 7.0), (1, 7.0)]
    for results, device in zip(local, two.devices, strict=True):
        for leaf in jax.tree.leaves(results):
            assert leaf.devices() == {device} and leaf.committed
    assert two.experimental_local_results({"plain": 5}) == ({"plain": 5}, {"plain": 5})


def test_values_from_function_keeps_python_values_per_replica(two):
    value = two.experimental_distribute_values_from_function(lambda context: context.replica_id_in_sync_group)
    assert isinstance(value, PerReplica) and _local(two, value) == [0, 1]
    # Weakly typed, as on one device: a Python float takes on the dtype of the array it meets.
    scale = two.experimental_distribute_values_from_function(
        lambda context: 0.5 * (context.replica_id_in_sync_group + 1)
    )
    assert scale.stacked.weak_type and scale.stacked.sharding == NamedSharding(two.mesh, P("replica"))
    scaled = two.run(lambda s: s * jnp.ones(2, jnp.bfloat16), args=(scale,))
    assert scaled.stacked.dtype == jnp.bfloat16 and _local(two, scaled) == [[0.5, 0.5], [1.0, 1.0]]
    one = OneDeviceStrategy().experimental_distribute_values_from_function(lambda context: 0.5)
    assert one.weak_type
    named = two.experimental_distribute_values_from_function(lambda context: {"name": "x", "v": 1.0})
    assert named["name"] == "x" and isinstance(named["v"], PerReplica)


@pytest.mark.parametrize(
    ("value_fn", "error", "message"),
    [
        (
            lambda c: np.zeros(c.replica_id_in_sync_group + 1),
            ValueError,
            r"same shape and dtype on every replica.*\n  replica 0: float32\[1\]\n  replica 1: float32\[2\]"
            r"\nTensorFlow allows components of different shapes; here pad them to one shape",
        ),
        (
            lambda c: {"a": 1} if c.replica_id_in_sync_group else [1],
            ValueError,
            r"different structures for replica 0",
        ),
        (
            lambda c: str(c.replica_id_in_sync_group),
            TypeError,
            r"value is not an array and differs between replicas \('0', '1'\)",
        ),
    ],
    ids=["shapes", "structures", "static"],
)
def test_values_from_function_errors(two, value_fn, error, message):
    with pytest.raises(error, match=message):
        two.experimental_distribute_values_from_function(value_fn)


# --- datasets ----------------------------------------------------------------------------------


def test_global_batches_are_split_along_the_first_axis(four):
    batches = [{"x": np.arange(8).reshape(8, 1) + 8 * i, "y": np.arange(8) % 2} for i in range(3)]
    dataset = four.experimental_distribute_dataset(batches)
    first = next(iter(dataset))
    assert isinstance(first["x"], PerReplica)
    assert [part.tolist() for part in four.experimental_local_results(first)[1]["x"]] == [[2], [3]]
    for part, device in zip(four.experimental_local_results(first), four.devices, strict=True):
        assert part["x"].devices() == {device}
    spec = dataset.element_spec
    assert spec["x"].stacked.shape == (4, 2, 1) and spec["x"].stacked.sharding.spec == jax.P("replica")
    assert len(dataset) == 3


def test_a_batch_that_does_not_split_evenly_is_an_error_by_default(four):
    dataset = four.experimental_distribute_dataset([np.zeros(8), np.zeros(5)])
    iterator = iter(dataset)
    next(iterator)
    with pytest.raises(
        ValueError,
        match=r"a batch of 5 examples, which does not split evenly over 4 replicas.*partial_batch='drop'.*'pad'",
    ):
        next(iterator)


def test_drop_skips_the_batch_with_a_warning_counting_its_examples(four):
    options = InputOptions(partial_batch="drop")
    dataset = four.experimental_distribute_dataset([np.zeros(8), np.zeros(5)], options)
    with pytest.warns(UserWarning, match=r"dropped a batch of 5 examples.* \(5 example\(s\)\)") as record:
        batches = list(dataset)
    assert len(batches) == 1
    # Warned in this thread, at the loop that read the batches, not in the producer thread.
    assert [warning.filename for warning in record] == [__file__]
    # A dropped first batch is skipped by element_spec too, with its warning.
    dataset = four.experimental_distribute_dataset([np.zeros(5), np.zeros(8)], options)
    with pytest.warns(UserWarning, match="dropped a batch of 5 examples"):
        assert dataset.element_spec.stacked.shape == (4, 2)
    assert [x.stacked.shape for x in dataset] == [(4, 2)]


def test_pad_yields_batches_with_a_mask_of_real_examples(four):
    options = InputOptions(partial_batch="pad")
    dataset = four.experimental_distribute_dataset([np.arange(1.0, 9.0), np.arange(1.0, 6.0)], options)
    (full, full_mask), (last, last_mask) = list(dataset)
    assert np.asarray(full_mask.stacked).all()
    assert _local(four, last) == [[1.0, 2.0], [3.0, 4.0], [5.0, 0.0], [0.0, 0.0]]
    assert _local(four, last_mask) == [[True, True], [True, True], [True, False], [False, False]]

    def masked_sum(x, mask):
        return jaxstrategy.get_replica_context().all_reduce("sum", jnp.sum(jnp.where(mask, x, 0.0)))

    assert float(four.run(masked_sum, args=(last, last_mask))) == 15.0


def test_pad_on_one_device_gives_the_same_structure():
    options = InputOptions(partial_batch="pad")
    ((batch, mask),) = list(OneDeviceStrategy().experimental_distribute_dataset([np.arange(3)], options))
    assert batch.tolist() == [0, 1, 2] and mask.tolist() == [True, True, True]


def test_one_replica_takes_unbatched_elements_whole_as_one_device_does(cpu_devices):
    one_replica = MirroredStrategy(cpu_devices[:1])
    elements = [{"step": np.int32(3), "x": np.arange(3.0)}, {"step": np.int32(4), "x": np.arange(2.0)}]
    batches = list(one_replica.experimental_distribute_dataset(elements))
    assert [int(_local(one_replica, b["step"])[0]) for b in batches] == [3, 4]
    assert [_local(one_replica, b["x"])[0] for b in batches] == [[0.0, 1.0, 2.0], [0.0, 1.0]]


def test_an_unbatched_element_cannot_be_split(two):
    with pytest.raises(ValueError, match=r"splits each batch along its first axis.*int64\[\]"):
        list(two.experimental_distribute_dataset([np.int64(3)]))


def test_host_batches_stay_numpy_per_replica(two):
    options = InputOptions(experimental_fetch_to_device=False)
    (batch,) = list(two.experimental_distribute_dataset([np.arange(4)], options))
    assert isinstance(batch.stacked, np.ndarray)
    assert all(isinstance(part, np.ndarray) for part in two.experimental_local_results(batch))
    assert _local(two, batch) == [[0, 1], [2, 3]]
    assert _local(two, two.run(lambda x: x * 2, args=(batch,))) == [[0, 2], [4, 6]]


def test_dataset_fn_input_context_rows(two):
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        assert context.get_per_replica_batch_size(64) == 32
        with pytest.raises(
            ValueError, match=r"`global_batch_size` 63 is not divisible by `num_replicas_in_sync` 2"
        ):
            context.get_per_replica_batch_size(63)
        return [np.arange(i, i + 2) for i in range(0, 8, 2)]

    dataset = two.distribute_datasets_from_function(dataset_fn)
    assert contexts == [
        jaxstrategy.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2)
    ]
    # Replicas take consecutive whole elements, as TensorFlow's range(8).batch(2) does.
    assert [_local(two, batch) for batch in dataset] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert len(dataset) == 2


def test_dataset_fn_leftover_elements_follow_the_partial_batch_option(two):
    elements = [np.arange(3) + i for i in range(3)]
    with pytest.raises(
        ValueError, match=r"got 1 element\(s\) for the 2 replicas at the end of the data"
    ) as raised:
        list(two.distribute_datasets_from_function(lambda _: elements))
    # Not "a multiple of 2", which a per-replica batch of 2 already is (issue 28, item 3).
    message = str(raised.value)
    assert (
        "Each step takes 2 consecutive elements, one per replica, each a whole per-replica batch" in message
    )
    assert "a multiple" not in message
    with pytest.warns(UserWarning, match=r"dropped 1 element\(s\) .* \(3 example\(s\)\)"):
        assert (
            len(
                list(
                    two.distribute_datasets_from_function(
                        lambda _: elements, InputOptions(partial_batch="drop")
                    )
                )
            )
            == 1
        )
    padded = list(
        two.distribute_datasets_from_function(lambda _: elements, InputOptions(partial_batch="pad"))
    )
    last, mask = padded[-1]
    assert _local(two, last) == [[2, 3, 4], [0, 0, 0]] and _local(two, mask) == [[True] * 3, [False] * 3]


@pytest.mark.parametrize(
    ("distribute", "batches_left"),
    [
        (lambda strategy, elements, options: strategy.experimental_distribute_dataset(elements, options), 3),
        (
            lambda strategy, elements, options: strategy.distribute_datasets_from_function(
                lambda _: elements, options
            ),
            1,
        ),
    ],
    ids=["split", "consecutive"],
)
def test_with_drop_the_number_of_batches_is_unknown_before_reading(two, distribute, batches_left):
    # Sizes [2, 1, 2, 2]: split drops the batch of 1; consecutive drops the step pairing 2 with 1.
    elements = [np.zeros(n) for n in (2, 1, 2, 2)]
    dataset = distribute(two, elements, InputOptions(partial_batch="drop"))
    assert dataset.cardinality == -2  # tf.data's UNKNOWN_CARDINALITY
    with pytest.raises(TypeError, match=r"partial_batch='drop'\) drops batches"):
        len(dataset)
    with pytest.warns(UserWarning, match="dropped"):
        assert len(list(dataset)) == batches_left


def test_dataset_fn_elements_of_different_sizes_are_an_error(two):
    with pytest.raises(ValueError, match=r"elements of different batch sizes \[2, 1\] for one step"):
        list(two.distribute_datasets_from_function(lambda _: [np.zeros(2), np.zeros(1)]))


def test_per_replica_mode_calls_dataset_fn_once_per_replica(two):
    contexts = []

    def dataset_fn(context):
        contexts.append(context)
        return [np.full(2, 10 * context.input_pipeline_id + step) for step in range(3)]

    options = InputOptions(experimental_replication_mode="PER_REPLICA")
    dataset = two.distribute_datasets_from_function(dataset_fn, options)
    assert contexts == [jaxstrategy.InputContext(2, 0, 2), jaxstrategy.InputContext(2, 1, 2)]
    assert [_local(two, batch) for batch in dataset][0] == [[0, 0], [10, 10]]
    assert len(dataset) == 3


def test_per_replica_mode_is_rejected_on_one_device():
    options = InputOptions(experimental_replication_mode="PER_REPLICA")
    with pytest.raises(NotImplementedError, match=r"strategy with several replicas \(MirroredStrategy\)"):
        OneDeviceStrategy().distribute_datasets_from_function(lambda _: [np.ones(1)], options)


# --- one codebase, two strategies ----------------------------------------------------------------


def _train(strategy, batches, steps=6):
    """A flax nnx MLP trained with optax through the strategy; returns the losses."""
    import optax
    from flax import nnx

    model = nnx.Sequential(nnx.Linear(8, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 1, rngs=nnx.Rngs(1)))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adam(1e-2)
    state = strategy.put({"params": params, "opt": tx.init(params)})

    def step(state, batch):
        def loss_fn(params):
            predictions = nnx.merge(graphdef, params)(batch["x"])
            return jnp.mean((predictions[:, 0] - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state["params"])
        context = jaxstrategy.get_replica_context()
        grads = context.all_reduce("mean", grads)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, context.all_reduce(
            "mean", loss
        )

    losses = []
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts.
        for batch in strategy.experimental_distribute_dataset(batches[:steps]):
            state, loss = strategy.run(step, args=(state, batch))
            losses.append(float(loss))
    assert_tree_on_strategy(state, strategy)
    return losses


def test_one_device_and_mirrored_training_give_the_same_losses(four):
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=16).astype(np.float32)}
        for _ in range(6)
    ]
    one = _train(OneDeviceStrategy(), batches)
    mirrored = _train(four, batches)
    np.testing.assert_allclose(mirrored, one, rtol=1e-5)
    assert one[-1] < one[0]


@pytest.mark.parametrize("direction", ["one->mirrored", "mirrored->one"])
def test_checkpoints_move_between_strategies(tmp_path, four, direction):
    from jaxstrategy import checkpoint

    one = OneDeviceStrategy("/cpu:1")
    source, target = (one, four) if direction == "one->mirrored" else (four, one)
    saved = source.put({"w": np.arange(6, dtype=np.float32).reshape(2, 3), "key": jax.random.key(1)})
    checkpoint.save(tmp_path, saved)
    restored = checkpoint.restore(tmp_path, strategy=target, target=saved)
    assert restored["w"].tolist() == saved["w"].tolist()
    assert_tree_on_strategy(restored, target)


def test_a_python_scalar_output_is_a_replicated_array(two):
    # As on OneDeviceStrategy: a constant is the same on every replica.
    out = two.run(lambda: 3)
    assert out.tolist() == 3
    assert out.sharding == two.sharding


_MANY_STEPS = """
import jax, jax.numpy as jnp, jaxstrategy
strategy = jaxstrategy.MirroredStrategy()
params = strategy.put(jnp.ones(16))
batch = strategy.experimental_distribute_values_from_function(lambda c: jnp.ones((16, 16)))

def step(params, x):
    grads = jaxstrategy.get_replica_context().all_reduce("mean", jnp.sum(x, axis=0) * params)
    return params - 0.001 * grads

for _ in range(2000):  # Never read: every step is dispatched ahead of the computation.
    params = strategy.run(step, args=(params, batch))
print("done", float(params[0]) > 0)
"""


@pytest.mark.slow  # A fresh process.
def test_many_steps_in_flight_on_cpu_devices_do_not_hang():
    # XLA's CPU client deadlocks in an all-reduce when dozens of such steps are queued (it aborts
    # the process after 40 s); run waits for every 8th step on CPU devices to prevent it.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    done = subprocess.run(
        [sys.executable, "-c", _MANY_STEPS], capture_output=True, text=True, timeout=300, env=env, check=False
    )
    assert done.stdout == "done True\n", done.stderr[-2000:]


_MANY_THREADS = """
import threading, jax.numpy as jnp, jaxstrategy
strategy = jaxstrategy.MirroredStrategy()
batch = strategy.experimental_distribute_values_from_function(lambda c: jnp.ones((16, 16)))

def step(params, x):
    grads = jaxstrategy.get_replica_context().all_reduce("mean", jnp.sum(x, axis=0) * params)
    return params - 0.001 * grads

def worker(results, i):
    params = strategy.put(jnp.ones(16))
    for _ in range(400):
        params = strategy.run(step, args=(params, batch))
    results[i] = float(params[0]) > 0

results = [False] * 8
threads = [threading.Thread(target=worker, args=(results, i)) for i in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print("done", all(results))
"""


@pytest.mark.slow  # A fresh process.
def test_many_threads_running_steps_on_cpu_devices_do_not_hang():
    # The every-8th-step wait is per strategy, across threads: counted per call only, 8 threads
    # queued enough steps for XLA's CPU all-reduce rendezvous to abort the process (after ~40 s).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    done = subprocess.run(
        [sys.executable, "-c", _MANY_THREADS],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.stdout == "done True\n", done.stderr[-2000:]


def test_local_results_reduce_and_gather_work_under_an_outer_jit(two):
    # TensorFlow's tutorial wraps run and reduce in a tf.function; the JAX user writes jax.jit.
    values = _per_replica(two, [np.float32([1.0, 2.0]), np.float32([3.0, 4.0])])

    def step(x):
        return x * 2, jaxstrategy.get_replica_context().all_reduce("sum", x)

    def everything(x):
        doubled, summed = two.run(step, args=(x,))
        return (
            two.experimental_local_results(doubled),
            two.experimental_local_results(summed),
            two.reduce("sum", doubled, axis=None),
            two.gather(doubled, axis=0),
        )

    eager, jitted = everything(values), jax.jit(everything)(values)
    for expected, got in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
    assert [np.asarray(v).tolist() for v in jitted[0]] == [[2.0, 4.0], [6.0, 8.0]]


def test_values_from_function_works_under_an_outer_jit(two):
    # TF's values_test builds the values inside a tf.function; the components are tracers here.
    @jax.jit
    def gathered():
        value = two.experimental_distribute_values_from_function(
            lambda context: jnp.full((2,), context.replica_id_in_sync_group + 1, jnp.float32)
        )
        return two.gather(two.run(lambda v: v * 10, args=(value,)), axis=0)

    assert np.asarray(gathered()).tolist() == [10.0, 10.0, 20.0, 20.0]


def test_in_one_process_a_jitted_function_may_close_over_a_per_replica(two):
    # docs/semantics.md: across processes JAX refuses this (pass the value as an argument; see
    # test_multi_worker.py); in one process every device is addressable, and it works.
    values = _per_replica(two, [np.float32([1.0, 2.0]), np.float32([3.0, 4.0])])
    closed_over = jax.jit(lambda: two.reduce("sum", two.run(lambda v: v * 2, args=(values,)), axis=None))
    passed = jax.jit(lambda x: two.reduce("sum", two.run(lambda v: v * 2, args=(x,)), axis=None))
    assert np.asarray(closed_over()).tolist() == np.asarray(passed(values)).tolist() == [8.0, 12.0]
