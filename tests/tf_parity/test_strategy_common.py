"""strategy_common_test.py: methods every strategy shares, on TF's `all_strategies` stand-ins
(combinations.py) and on `multi_worker_mirrored_2x1_cpu` (a real job of two processes, cases in
two_process_worker.py). `tf.function` becomes `jax.jit`.

Skipped, as TF internals:
- ReplicaCtxUpdateTest.testDenseUpdate: the private `ReplicaContext._update` of tf.Variables.
- ReplicaCtxAllReduceTest (all four): the private `extended._replica_ctx_all_reduce` (the public
  `all_reduce` is AllReduceTest's) and ON_READ variables (testSyncOnReadVariableInput).
- AllReduceTest.testSparse, testSparseTuple: `tf.IndexedSlices`, which JAX has no counterpart of
  (testNestedInput runs with their dense values).
- DistributedCollectiveAllReduceStrategyTest.testReduceToHostTensor, testBatchReduceToHostTensor,
  testReduceToDeviceTensors, testBatchReduceToDeviceTensors: `StrategyExtended.reduce_to` and
  `batch_reduce_to`; jaxstrategy's `extended` holds device names and role flags only (README API
  table); `strategy.reduce` is translated in testReduceHostTensor and testReduceDeviceTensors.
- StrategyLocalResultTest on multi_worker_mirrored_2x2_gpu and TPU: GPU/TPU combinations; it runs
  on mirrored_strategy_with_cpu_1_and_2 as in TF.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxstrategy import ReduceOp, get_replica_context
from tf_parity import combinations as c
from tf_parity.test_strategy_test_lib import local, mine

TF_FILE = "strategy_common_test.py"
ALL = pytest.mark.parametrize("distribution", c.all_strategies, indirect=True, ids=str)
TF_FUNCTION = pytest.mark.parametrize("tf_function", [False, True], ids=["no_tf_function", "tf_function"])


# --- StrategyTest ------------------------------------------------------------------------------


@ALL
def test_capture_replica_id(distribution):
    """strategy_common_test.py: StrategyTest.testCaptureReplicaId

    `run` inside a compiled function, which TF traces twice (a variable is made on the first
    trace); here the compiled function is called twice."""
    f = jax.jit(lambda: get_replica_context().replica_id_in_sync_group)
    g = jax.jit(lambda: distribution.run(f))
    n = distribution.num_replicas_in_sync
    assert [local(distribution, g()) for _ in range(2)] == [mine(distribution, list(range(n)))] * 2


@ALL
def test_merge_call_init_scope(distribution):
    """strategy_common_test.py: StrategyTest.testMergeCallInitScope

    TF: merge_fn returns 11 and every replica gets 12. Departure: README MirroredStrategy table
    row `merge_call` (NotImplementedError, on OneDeviceStrategy too)."""
    with distribution.scope():

        @jax.jit
        def fn():
            def replica_fn():
                y = get_replica_context().merge_call(lambda _: jnp.int32(11))
                return y + 1

            return distribution.run(replica_fn)

        with pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
            fn()


# --- StrategyLocalResultTest -------------------------------------------------------------------

LOCAL_RESULT = pytest.mark.parametrize(
    "distribution", [c.mirrored_strategy_with_cpu_1_and_2], indirect=True, ids=str
)


@LOCAL_RESULT
def test_local_result_for_dictionary(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForDictionary"""

    @jax.jit
    def model_fn():
        return {"a": jnp.float32(1.0), "b": jnp.float32(2.0)}

    with distribution.scope():
        result = distribution.run(model_fn)
        assert local(distribution, result) == [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}]


@LOCAL_RESULT
def test_local_result_for_list(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForList"""

    @jax.jit
    def model_fn():
        return [jnp.float32(1.0), jnp.float32(2.0)]

    with distribution.scope():
        result = distribution.run(model_fn)
        assert local(distribution, result) == [[1.0, 2.0], [1.0, 2.0]]


@LOCAL_RESULT
def test_local_result_for_tuple(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForTuple"""

    @jax.jit
    def model_fn():
        return jnp.float32(1.0), jnp.float32(2.0), jnp.float32(3.0)

    with distribution.scope():
        result = distribution.run(model_fn)
        got = distribution.experimental_local_results(result)
        assert isinstance(got, tuple)
        assert local(distribution, result) == [(1.0, 2.0, 3.0), (1.0, 2.0, 3.0)]


@LOCAL_RESULT
def test_local_result_for_nested_struct(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForNestedStruct"""

    @jax.jit
    def model_fn():
        return {"a": jnp.float32(1.0), "b": jnp.float32(2.0)}, {"a": jnp.float32(4.0), "b": jnp.float32(6.0)}

    with distribution.scope():
        result = distribution.run(model_fn)
        expected = ({"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 6.0})
        assert local(distribution, result) == [expected, expected]


@LOCAL_RESULT
def test_local_result_for_nested_struct_without_tensor(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForNestedStructWithoutTensor"""

    @jax.jit
    def model_fn():
        return {"a": 1.0, "b": 2.0}

    with distribution.scope():
        result = distribution.run(model_fn)
        v = distribution.experimental_local_results(result)
        assert isinstance(v, tuple)
        assert local(distribution, result) == [{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 2.0}]


@LOCAL_RESULT
def test_local_result_for_scalar_value(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForScalarValue (TF's private
    `_get_local_replica_id` of the replica id is the replica id with one process)"""

    @jax.jit
    def model_fn():
        return get_replica_context().replica_id_in_sync_group

    with distribution.scope():
        result = distribution.run(model_fn)
        v = distribution.experimental_local_results(result)
        assert isinstance(v, tuple)
        assert local(distribution, result) == [0, 1]


@LOCAL_RESULT
def test_local_result_for_dictionary_different_replicas(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForDictionaryDifferentReplicas"""

    @jax.jit
    def model_fn():
        replica_id = get_replica_context().replica_id_in_sync_group
        return {"a": (replica_id + 1).astype(jnp.float32), "b": (replica_id + 2).astype(jnp.float32)}

    with distribution.scope():
        result = distribution.run(model_fn)
        assert local(distribution, result) == [{"a": 1.0, "b": 2.0}, {"a": 2.0, "b": 3.0}]


@LOCAL_RESULT
def test_local_result_for_tensor(distribution):
    """strategy_common_test.py: StrategyLocalResultTest.testLocalResultForTensor"""

    @jax.jit
    def model_fn():
        return jnp.array([2.0, 3.0], jnp.float32)

    with distribution.scope():
        result = distribution.run(model_fn)
        assert local(distribution, result) == [[2.0, 3.0], [2.0, 3.0]]


# --- ReduceTest --------------------------------------------------------------------------------


@ALL
@TF_FUNCTION
def test_reduce_basic(distribution, tf_function):
    """strategy_common_test.py: ReduceTest.testBasic (fn_eager, and fn_graph: its jax.jit)"""
    per_replica_value = distribution.experimental_distribute_values_from_function(
        lambda _: jnp.ones((), jnp.float32)
    )

    def fn_eager():
        return distribution.reduce(ReduceOp.SUM, value=per_replica_value, axis=None)

    fn = jax.jit(fn_eager) if tf_function else fn_eager
    n = distribution.num_replicas_in_sync
    with distribution.scope():  # Explicitly in the strategy's scope.
        assert float(fn()) == 1.0 * n
    assert float(fn()) == 1.0 * n  # And implicitly.


@ALL
def test_reduce_axis(distribution):
    """strategy_common_test.py: ReduceTest.testAxis

    `fn` returns the same [1., 2.] on every replica: MEAN along axis 0 is 1.5 and SUM is 3 per
    replica."""
    x = distribution.run(jax.jit(lambda: jnp.array([1.0, 2.0], jnp.float32)))
    assert float(distribution.reduce(ReduceOp.MEAN, x, axis=0)) == 1.5
    assert float(distribution.reduce(ReduceOp.SUM, x, axis=0)) == 3 * distribution.num_replicas_in_sync


# --- AllReduceTest ------------------------------------------------------------------------------


@ALL
@TF_FUNCTION
def test_all_reduce_dense(distribution, tf_function):
    """strategy_common_test.py: AllReduceTest.testDense"""

    def replica_fn():
        return get_replica_context().all_reduce(ReduceOp.SUM, jnp.float32(1.0))

    def fn():
        return distribution.experimental_local_results(distribution.run(replica_fn))

    got = (jax.jit(fn) if tf_function else fn)()[0]
    assert float(got) == 1.0 * distribution.num_replicas_in_sync


@ALL
@TF_FUNCTION
def test_all_reduce_nested_input(distribution, tf_function):
    """strategy_common_test.py: AllReduceTest.testNestedInput (its IndexedSlices as their dense
    values, which JAX has no sparse type for)"""

    def replica_fn():
        value = (
            jnp.float32(1.0),
            jnp.array([[1.0]], jnp.float32),
            jnp.float32(2.0),
            jnp.array([[2.0]], jnp.float32),
        )
        return get_replica_context().all_reduce(ReduceOp.SUM, value)

    def fn():
        return distribution.experimental_local_results(distribution.run(replica_fn))

    got = jax.tree.map(lambda x: x.tolist(), (jax.jit(fn) if tf_function else fn)()[0])
    n = float(distribution.num_replicas_in_sync)
    assert got == (1.0 * n, [[1.0 * n]], 2.0 * n, [[2.0 * n]])


# --- StrategyClusterResolverTest ----------------------------------------------------------------


@ALL
def test_cluster_resolver_property(distribution):
    """strategy_common_test.py: StrategyClusterResolverTest.testClusterResolverProperty (strategies
    without a cluster: the resolver is None)"""
    assert distribution.cluster_resolver is None


# --- multi_worker_mirrored_2x1_cpu ------------------------------------------------------------


def test_two_process(two_process_case):
    """strategy_common_test.py on multi_worker_mirrored_2x1_cpu, a real job of two processes (chief
    and worker); the case id names the TF test (see two_process_worker.py)."""
    two_process_case.check()
