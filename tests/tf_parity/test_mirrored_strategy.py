"""mirrored_strategy_test.py, on TF's mirrored combinations: two devices ('/cpu:0', '/cpu:1' stand in
for `mirrored_strategy_with_gpu_and_cpu` and the two-GPU ones) and one device (`with_one_cpu`, and
'/cpu:1' for `with_one_gpu`).

TF runs each test in eager and graph mode; graph mode is TF plumbing, so each runs once here. The
checks come from strategy_test_lib.py (test_strategy_test_lib.py), as in TF. TF's variables are
jax arrays placed with `strategy.put`; an assignment is a new array.

Skipped, as TF internals:
- MirroredTwoDeviceDistributionTest.testMakeInputFnIteratorWithDataset, ...WithCallable,
  testNumpyDataset: TF1 entry points (`make_input_fn_iterator`, one-shot iterators, numpy datasets).
- MirroredTwoDeviceDistributionTest.testGlobalStepUpdate, testTrainableVariables: variable
  aggregation (ONLY_FIRST_REPLICA) and synchronization (ON_READ).
- MirroredTwoDeviceDistributionTest.testSummaryForReplicaZeroOnly: tf.summary writers.
- MirroredTwoDeviceDistributionTest.testReduceAxisToCpuUnknownShape: TensorShape v1/v2 and
  shapes erased by placeholder_with_default; its values are testReduceAxisToCpu's.
- MirroredCollectiveOpTest, MirroredGetCrossDeviceOpTest: which private cross-device ops
  (`extended._collective_ops`, NCCL/RING) TF picks; XLA chooses here.
- MirroredStrategyVariableCreatorStackTest, MirroredStrategyNameScopeTest,
  MirroredThreeDeviceDistributionTest: variable creator scopes, op and variable names, and
  MirroredVariables created inside the replica function, in graph mode.
- MirroredStrategyCallForEachReplicaTest.testExecutingEagerlyOutsideFunction: TF's eager/graph
  state (`executing_eagerly_outside_functions`).
- MirroredVariableUpdateTest's ...WithSum, ...ReplicaContext and ...WithSingleValue tests (7):
  variable aggregation (SUM/MEAN) of assignments in the replica context.
- MirroredAndSyncOnReadVariableInitializerTest, SyncOnReadVariableAssignTest: graph-mode
  initializers and ON_READ variables.
- MultiWorkerMirroredStrategyTest, RemoteSingleWorkerMirroredStrategyGraph,
  MultiWorkerMirroredStrategyTestWithChief: TF1 multi-worker MirroredStrategy (`configure` with a
  cluster spec, in-process clusters, Sessions, GPUs); MultiWorkerMirroredStrategy's own tests are
  the two-process cases of the other modules.
- MirroredVariableStopGradientTest: graph-mode `tf.gradients(stop_gradients=)` of a variable.
- FunctionTest.testFuctionPreservesAutoGraph, testPreserveTracebackFiltering: AutoGraph and TF's
  traceback filtering.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import ReduceOp, get_replica_context
from tf_parity import combinations as c
from tf_parity import test_strategy_test_lib as lib
from tf_parity.test_strategy_test_lib import local

TWO = pytest.mark.parametrize("distribution", [c.mirrored_strategy_with_gpu_and_cpu], indirect=True, ids=str)
mirrored_strategy_with_one_gpu = c.NamedDistribution(
    "mirrored_strategy_with_one_gpu(cpu:1)", lambda: jaxstrategy.MirroredStrategy(["/cpu:1"]), 1
)
ONE = pytest.mark.parametrize(
    "distribution", [c.mirrored_strategy_with_one_cpu, mirrored_strategy_with_one_gpu], indirect=True, ids=str
)
COLLECTIVE_IDS = [
    "testAllReduceSum",
    "testAllReduceSumGradients",
    "testAllReduceSumGradientTape",
    "testAllReduceMean",
    "testAllReduceMeanGradients",
    "testAllReduceMeanGradientTape",
]


def _replica_id():
    return get_replica_context().replica_id_in_sync_group


# --- MirroredTwoDeviceDistributionTest ---------------------------------------------------------


@TWO
def test_two_device_minimize_loss(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testMinimizeLoss"""
    lib.check_minimize_loss_eager(distribution)


@TWO
def test_two_device_replica_id(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testReplicaId"""
    lib.check_replica_id(distribution)


@TWO
def test_two_device_num_replicas_in_sync(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testNumReplicasInSync"""
    assert distribution.num_replicas_in_sync == 2


@TWO
def test_two_device_call_and_merge_exceptions_call(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testCallAndMergeExceptions
    (the exception of the replica function propagates)"""
    lib.check_call_exceptions(distribution)


@TWO
def test_two_device_call_and_merge_exceptions_merge(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testCallAndMergeExceptions
    (merge_call). Departure: README MirroredStrategy table row `merge_call`."""
    lib.check_merge_exceptions(distribution)


@TWO
def test_run_regroup_error(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testRunRegroupError

    TF runs `fn` per replica and fails to regroup lists of different lengths (AssertionError).
    Departure: README MirroredStrategy table row "how fn runs" (traced once, one SPMD program):
    such outputs cannot be written; the Python `int` of the traced replica id is JAX's error.
    """

    def run_fn():
        replica_id = int(get_replica_context().replica_id_in_sync_group)
        return list(range(replica_id))

    with distribution.scope(), pytest.raises(jax.errors.ConcretizationTypeError, match=r"`int` function"):
        distribution.run(run_fn)


@TWO
def test_reduce_to_cpu(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testReduceToCpu"""
    with distribution.scope():
        result = distribution.run(_replica_id)
        reduced = distribution.reduce(ReduceOp.SUM, result, axis=None)
    assert int(reduced) == sum(range(distribution.num_replicas_in_sync)) == 1


@TWO
def test_reduce_to_cpu_nested(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testReduceToCpuNested"""
    with distribution.scope():

        def replica_fn(input_tensor):
            return input_tensor + jnp.float32(1.0), input_tensor - jnp.float32(1.0)

        run_result = distribution.run(replica_fn, args=(jnp.float32(3.0),))
        reduced_result = distribution.reduce("SUM", run_result, axis=None)
    n = distribution.num_replicas_in_sync
    assert jax.tree.map(float, reduced_result) == (4.0 * n, 2.0 * n)


@TWO
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int32], ids=["float32", "int32"])
def test_reduce_axis_to_cpu(distribution, dtype):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testReduceAxisToCpu (and its
    reduce_axis_helper)

    TF: replica r returns [r] * (r + 1), lists of different lengths, and `reduce` along axis 0
    gives SUM 2 and MEAN 2 / 3 (the global sum over the global count). Departure: README
    MirroredStrategy table row "per-replica values of different shapes" (a ValueError listing each
    replica's shape). The same global SUM and MEAN hold for values of one shape."""
    with distribution.scope(), pytest.raises(ValueError, match=r"same shape and dtype on every replica"):
        distribution.experimental_distribute_values_from_function(
            lambda ctx: jnp.array([ctx.replica_id_in_sync_group] * (ctx.replica_id_in_sync_group + 1), dtype)
        )
    # Replica r holds [r, r]: SUM 0 + 0 + 1 + 1 = 2, MEAN 2 / 4.
    with distribution.scope():
        result = distribution.experimental_distribute_values_from_function(
            lambda ctx: jnp.array([ctx.replica_id_in_sync_group] * 2, dtype)
        )
        reduced_sum = distribution.reduce(ReduceOp.SUM, result, axis=0)
        reduced_mean = distribution.reduce(ReduceOp.MEAN, result, axis=0)
    assert float(reduced_sum) == pytest.approx(2.0, abs=1e-5)
    assert float(reduced_mean) == pytest.approx(0.5, abs=1e-5)


@TWO
def test_replicate_dataset(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testReplicateDataset"""
    lib.check_input_fn_iterable(
        distribution,
        lambda: [np.int64(i) for i in range(10)],  # Dataset.range(10)
        [[i, i + 1] for i in range(0, 10, 2)],
        expected_num_replicas_in_sync=2,
        expected_num_input_pipelines=1,
        expected_input_pipeline_id=0,
    )


@TWO
def test_two_device_run(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testRun"""
    lib.check_run(distribution)


@TWO
@pytest.mark.parametrize("name", lib.COLLECTIVES, ids=COLLECTIVE_IDS)
def test_two_device_all_reduce(distribution, name):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.testAllReduce{Sum,Mean}
    [Gradients, GradientTape] (the id names the method)"""
    lib.check_two_device_collectives(distribution, name)


def _first_element(distribution, options):
    dataset = np.arange(100).reshape(-1, distribution.num_replicas_in_sync)  # range(100).batch(n)
    return next(iter(distribution.experimental_distribute_dataset(list(dataset), options=options)))


@TWO
def test_prefetch_to_device_dataset(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.test_prefetch_to_device_dataset

    Each replica's part is on its replica's device (TF compares device types; here devices)."""
    item = _first_element(distribution, jaxstrategy.InputOptions(experimental_fetch_to_device=True))
    assert [v.devices() for v in item.values] == [{d} for d in distribution.devices]
    assert [v.tolist() for v in item.values] == [[0], [1]]


@TWO
def test_prefetch_to_host_dataset(distribution):
    """mirrored_strategy_test.py: MirroredTwoDeviceDistributionTest.test_prefetch_to_host_dataset

    With `experimental_fetch_to_device=False` every part stays in host memory (numpy arrays)."""
    item = _first_element(distribution, jaxstrategy.InputOptions(experimental_fetch_to_device=False))
    assert all(isinstance(v, np.ndarray) for v in item.values)
    assert [v.tolist() for v in item.values] == [[0], [1]]


# --- MirroredOneDeviceDistributionTest ---------------------------------------------------------


@ONE
def test_one_device_minimize_loss(distribution):
    """mirrored_strategy_test.py: MirroredOneDeviceDistributionTest.testMinimizeLoss"""
    lib.check_minimize_loss_eager(distribution)


@ONE
def test_one_device_replica_id(distribution):
    """mirrored_strategy_test.py: MirroredOneDeviceDistributionTest.testReplicaId"""
    lib.check_replica_id(distribution)


@ONE
def test_one_device_call_and_merge_exceptions_call(distribution):
    """mirrored_strategy_test.py: MirroredOneDeviceDistributionTest.testCallAndMergeExceptions"""
    lib.check_call_exceptions(distribution)


@ONE
def test_one_device_call_and_merge_exceptions_merge(distribution):
    """mirrored_strategy_test.py: MirroredOneDeviceDistributionTest.testCallAndMergeExceptions
    (merge_call). Departure: README MirroredStrategy table row `merge_call`."""
    lib.check_merge_exceptions(distribution)


@ONE
def test_one_device_run(distribution):
    """mirrored_strategy_test.py: MirroredOneDeviceDistributionTest.testRun"""
    lib.check_run(distribution)


@ONE
@pytest.mark.parametrize("name", lib.COLLECTIVES, ids=COLLECTIVE_IDS)
def test_one_device_all_reduce(distribution, name):
    """mirrored_strategy_test.py: MirroredOneDeviceDistributionTest.testAllReduce{Sum,Mean}
    [Gradients, GradientTape] (the id names the method)"""
    lib.check_one_device_collectives(distribution, name)


# --- MirroredStrategyCallForEachReplicaTest ----------------------------------------------------


@TWO
def test_function_in_call_for_each_replica(distribution):
    """mirrored_strategy_test.py: MirroredStrategyCallForEachReplicaTest.testFunctionInCallForEachReplica

    Departure: README MirroredStrategy table row "how fn runs": TF traces the tf.function once
    per replica (2 traces); here the function is traced once for all replicas."""
    traces = []

    @jax.jit
    def model_fn():
        traces.append(1)
        return get_replica_context().replica_id_in_sync_group

    with distribution.scope():
        result = distribution.run(model_fn)
    assert local(distribution, result) == [0, 1]
    assert len(traces) == 1


@TWO
def test_function_in_call_for_each_replica_inside_another_function(distribution):
    """mirrored_strategy_test.py: MirroredStrategyCallForEachReplicaTest.
    testFunctionInCallForEachReplicaInsideAnotherFunction

    Departure: README MirroredStrategy table row "how fn runs" (one trace, not one per replica)."""
    traces = []

    @jax.jit
    def model_fn():
        traces.append(1)
        return get_replica_context().replica_id_in_sync_group

    @jax.jit
    def step():
        return distribution.run(model_fn)

    with distribution.scope():
        result = step()
    assert local(distribution, result) == [0, 1]
    assert len(traces) == 1


def _merge_fn(strategy, value):
    return strategy.reduce(ReduceOp.SUM, value, axis=None)


@TWO
def test_control_flow_function_in_call_for_each_replica_with_merge_call(distribution):
    """mirrored_strategy_test.py: MirroredStrategyCallForEachReplicaTest.
    testControlFlowFunctionInCallForEachReplicaWithMergeCall

    TF: RuntimeError "`merge_call` called while defining a new graph". Departure: README
    MirroredStrategy table row `merge_call` (NotImplementedError everywhere)."""

    @jax.jit
    def model_fn():
        def body_fn(i):
            return get_replica_context().merge_call(_merge_fn, args=(i,))

        return jax.lax.while_loop(lambda i: i < 2, body_fn, 0)

    with distribution.scope(), pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
        distribution.run(model_fn)


@TWO
def test_nested_function_in_call_for_each_replica_with_merge_call(distribution):
    """mirrored_strategy_test.py: MirroredStrategyCallForEachReplicaTest.
    testNestedFunctionInCallForEachReplicaWithMergeCall

    TF: RuntimeError "`merge_call` called while defining a new graph". Departure: README
    MirroredStrategy table row `merge_call`."""

    def model_fn():
        @jax.jit
        def model_fn_nested():
            t = jnp.int32(1)
            return get_replica_context().merge_call(_merge_fn, args=(t,))

        return model_fn_nested()

    with distribution.scope(), pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
        distribution.run(model_fn)


@TWO
def test_function_in_call_for_each_replica_with_merge_call(distribution):
    """mirrored_strategy_test.py: MirroredStrategyCallForEachReplicaTest.
    testFunctionInCallForEachReplicaWithMergeCall

    TF runs the merge_call (its merge_fn does nothing) and returns 0. Departure: README
    MirroredStrategy table row `merge_call` (NotImplementedError)."""

    @jax.jit
    def model_fn():
        get_replica_context().merge_call(lambda _: None)
        return jnp.float32(0.0)

    with distribution.scope(), pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
        distribution.run(model_fn)


@TWO
def test_function_in_call_for_each_replica_cached(distribution):
    """mirrored_strategy_test.py: MirroredStrategyCallForEachReplicaTest.testFunctionInCallForEachReplicaCached

    Calling the same function 10 times traces it only on the first call."""
    traces = []

    @jax.jit
    def model_fn():
        traces.append(None)

    assert not traces
    for i in range(10):
        distribution.run(model_fn)
        if i == 0:
            num_traces = len(traces)
            assert num_traces > 0
        else:
            assert len(traces) == num_traces


# --- MirroredVariableUpdateTest (the assignments without aggregation) --------------------------


@TWO
def test_assign_mirrored_var_replica_context_without_aggregation_type(distribution):
    """mirrored_strategy_test.py: MirroredVariableUpdateTest.testAssignMirroredVarReplicaContextWithoutAggregationType

    Every replica assigns 5.0: the new variable is 5.0, one replicated array."""
    with distribution.scope():
        mirrored_var = distribution.put(1.0)
        mirrored_var = distribution.run(lambda v: jnp.full_like(v, 5.0), args=(mirrored_var,))
    assert isinstance(mirrored_var, jax.Array)  # Not a PerReplica: the same on every replica.
    assert float(mirrored_var) == 5.0


@TWO
def test_assign_mirrored_var_cross_device_context(distribution):
    """mirrored_strategy_test.py: MirroredVariableUpdateTest.testAssignMirroredVarCrossDeviceContext"""
    with distribution.scope():
        mirrored_var = distribution.put(1.0)
        assert float(mirrored_var) == 1.0
        mirrored_var = distribution.put(jnp.full_like(mirrored_var, 6.0))
    assert float(mirrored_var) == 6.0
    assert local(distribution, mirrored_var) == [6.0, 6.0]


def _check_components(distribution, mirrored_var, expected):
    """Each replica's copy holds `expected`, on its worker device (TF's `_devices`)."""
    components = distribution.experimental_local_results(mirrored_var)
    assert [float(v) for v in components] == [expected] * 2
    assert [v.devices() for v in components] == [{d} for d in distribution.devices]


@TWO
def test_assign_add_mirrored_var_cross_device_context(distribution):
    """mirrored_strategy_test.py: MirroredVariableUpdateTest.testAssignAddMirroredVarCrossDeviceContext"""
    with distribution.scope():
        mirrored_var = distribution.put(1.0)
        assert float(mirrored_var) == 1.0
        mirrored_var = mirrored_var + 6.0  # assign_add(6.0, read_value=True)
        assert float(mirrored_var) == 7.0
        _check_components(distribution, mirrored_var, 7.0)
        mirrored_var = mirrored_var + 2.0  # assign_add(2.0, read_value=False)
        _check_components(distribution, mirrored_var, 9.0)


@TWO
def test_assign_sub_mirrored_var_cross_device_context(distribution):
    """mirrored_strategy_test.py: MirroredVariableUpdateTest.testAssignSubMirroredVarCrossDeviceContext"""
    with distribution.scope():
        mirrored_var = distribution.put(5.0)
        assert float(mirrored_var) == 5.0
        mirrored_var = mirrored_var - 2.0
        assert float(mirrored_var) == 3.0
        _check_components(distribution, mirrored_var, 3.0)


# --- FunctionTest ------------------------------------------------------------------------------


@TWO
def test_backward_function_device_placement(distribution):
    """mirrored_strategy_test.py: FunctionTest.testBackwardFunctionDevicePlacement

    The gradients of a compiled forward function, taken in every replica, are 1.0 and computed on
    both devices (TF inspects run metadata for the gradient node's devices; here each replica's
    result is on its device)."""
    with distribution.scope():
        w = distribution.put(jnp.array([1.5], jnp.float32))
        b = distribution.put(jnp.array([0.5], jnp.float32))

    @jax.jit
    def forward(x, w, b):
        return x * w + b

    def replica_fn(w, b):
        x = jnp.array([1.0], jnp.float32)
        return jax.grad(lambda w, b: jnp.sum(forward(x, w, b) - 1.0), argnums=(0, 1))(w, b)

    with distribution.scope():
        g1, g2 = distribution.run(replica_fn, args=(w, b))
    for g in (g1, g2):
        components = distribution.experimental_local_results(g)
        assert [v.tolist() for v in components] == [[1.0], [1.0]]
        assert [v.devices() for v in components] == [{d} for d in distribution.devices]
