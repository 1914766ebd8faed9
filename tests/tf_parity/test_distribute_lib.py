"""distribute_lib_test.py: the Strategy base API, contexts and `InputContext`.

TF tests its base class through `_TestStrategy`, a one-device strategy with a fake `extended`;
`OneDeviceStrategy('/cpu:0')` stands in for it here. Where TF builds a second `_TestStrategy` to
show that mixing strategies is an error, the second one here is `OneDeviceStrategy('/cpu:1')`:
two strategies on one device are equal and share a scope (see test_equal_strategies_share_a_scope).

Skipped, as TF internals:
- TestStrategyTest.testScopeDeviceNestingError, testScopeVarCreatorNestingError,
  testScopeVarScopeNestingError: TF's device, variable-creator and variable scope stacks.
- TestStrategyTest.testSettingSynchronizationAndAggregation, and the variable creation inside
  testCallForEachReplica and testScope: the strategy's `_create_variable` hook and variable
  synchronization/aggregation.
- TestStrategyTest.testMakeInputFnIterator, DefaultDistributionStrategyTest.testV1: TF1 entry points.
- TestStrategyTest.testExperimentalRunStepsOnIterator, testReduceTo, testBatchReduceTo,
  testUpdate, testUpdateAutoGraph, testUpdateNonSlot, testUpdateNonSlotAutoGraph, and the
  `extended.reduce_to`/`batch_reduce_to` half of testReductions_acceptStringOps:
  `StrategyExtended` methods; jaxstrategy's `extended` holds device names and role flags only
  (README API table).
- The custom `_TestReplicaContext.merge_call` in testCallForEachReplica, the private
  `extended._cluster_resolver` in testClusterResolverDefaultNotImplemented, and
  `get_cross_replica_context` (not in TF2's public API) in every test.
- DefaultDistributionStrategyTest.testMergeCallAutoGraph: AutoGraph.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import InputContext, ReduceOp


def assert_in_default_state():
    """distribute_lib_test.py: _assert_in_default_state (public parts)."""
    default = jaxstrategy.get_strategy()
    assert jaxstrategy.get_strategy() is default  # TF: `is _get_default_strategy()`.
    replica_context = jaxstrategy.get_replica_context()  # TF: the default replica context.
    assert replica_context is not None
    assert replica_context.strategy is default and replica_context.replica_id_in_sync_group == 0
    assert not jaxstrategy.in_cross_replica_context()
    assert not jaxstrategy.has_strategy()


def _test_strategy():
    return jaxstrategy.OneDeviceStrategy("/cpu:0")


def _another_strategy():
    return jaxstrategy.OneDeviceStrategy("/cpu:1")


def run_in_and_out_of_scope(unbound_test_method):
    """distribute_lib_test.py: _run_in_and_out_of_scope: outside any scope, in the strategy's
    scope, and (an error) in another strategy's scope."""

    def wrapper():
        dist = _test_strategy()
        assert_in_default_state()
        unbound_test_method(dist)
        with dist.scope():
            unbound_test_method(dist)
        assert_in_default_state()
        with pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"):
            with _another_strategy().scope():
                unbound_test_method(dist)

    wrapper.__name__ = unbound_test_method.__name__
    wrapper.__doc__ = unbound_test_method.__doc__
    return wrapper


# --- TestStrategyTest --------------------------------------------------------------------------


def test_call_for_each_replica():
    """distribute_lib_test.py: TestStrategyTest.testCallForEachReplica (`extended.call_for_each_replica`
    is `run` here)"""
    assert_in_default_state()
    dist = _test_strategy()
    checked = []

    def make_run_fn():  # A new function object per call, so that each call traces it.
        def run_fn():
            replica_context = jaxstrategy.get_replica_context()
            assert replica_context is not None
            assert not jaxstrategy.in_cross_replica_context()
            assert jaxstrategy.has_strategy()
            assert jaxstrategy.get_strategy() is dist
            checked.append(True)

        return run_fn

    dist.run(make_run_fn())
    with dist.scope():
        dist.run(make_run_fn())
    assert checked == [True, True]
    assert_in_default_state()


def test_scope():
    """distribute_lib_test.py: TestStrategyTest.testScope"""
    assert_in_default_state()
    dist = _test_strategy()
    with dist.scope():
        assert jaxstrategy.get_replica_context() is None
        assert jaxstrategy.in_cross_replica_context()
        assert jaxstrategy.has_strategy()
        assert jaxstrategy.get_strategy() is dist
    assert_in_default_state()


def test_set_strategy():
    """distribute_lib_test.py: TestStrategyTest.testSetStrategy"""
    assert_in_default_state()
    dist = _test_strategy()
    dist2 = _another_strategy()
    set_strategy = jaxstrategy.experimental_set_strategy
    try:
        set_strategy(dist)
        assert jaxstrategy.get_replica_context() is None
        assert jaxstrategy.in_cross_replica_context()
        assert jaxstrategy.has_strategy()
        assert jaxstrategy.get_strategy() is dist
        set_strategy(dist2)
        assert jaxstrategy.get_strategy() is dist2
    finally:
        set_strategy(None)
    assert_in_default_state()


def test_set_strategy_in_scope():
    """distribute_lib_test.py: TestStrategyTest.testSetStrategyInScope"""
    assert_in_default_state()
    dist = _test_strategy()
    with dist.scope():
        for strategy in (_another_strategy(), dist, None):
            with pytest.raises(RuntimeError, match=r"Must not be called inside a `.*Strategy` scope"):
                jaxstrategy.experimental_set_strategy(strategy)
    assert_in_default_state()


def test_same_scope_nesting():
    """distribute_lib_test.py: TestStrategyTest.testSameScopeNesting (a scope object may be entered
    again, also inside another scope of the same strategy)"""
    assert_in_default_state()
    dist = _test_strategy()
    scope_a = dist.scope()
    with scope_a:
        assert jaxstrategy.get_strategy() is dist
        scope_b = dist.scope()
        with scope_b:
            assert jaxstrategy.get_strategy() is dist
            with scope_a:
                assert jaxstrategy.get_strategy() is dist
            assert jaxstrategy.get_strategy() is dist
        assert jaxstrategy.get_strategy() is dist
        scope2 = _another_strategy().scope()
        with pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"):
            with scope2:
                pass
    assert_in_default_state()
    with scope_b:
        assert jaxstrategy.get_strategy() is dist
    assert_in_default_state()


def test_equal_strategies_share_a_scope():
    """distribute_lib_test.py: TestStrategyTest.testSameScopeNesting (its dist2, a second
    `_TestStrategy` on the same device).

    Departure: README API table row `repr(strategy)` ("strategies on one device are equal"; TF:
    "equal strategies are distinct objects"), so TF's "Mixing different" error needs a strategy on
    another device; one on the same device enters the same scope."""
    dist = _test_strategy()
    with dist.scope(), _test_strategy().scope():
        assert jaxstrategy.get_strategy() == dist
    assert_in_default_state()


@run_in_and_out_of_scope
def test_reduce(dist):
    """distribute_lib_test.py: TestStrategyTest.testReduce"""
    x = jnp.float32(1.0)
    assert float(dist.reduce(ReduceOp.MEAN, x, axis=None)) == float(x)


def test_reductions_accept_string_ops():
    """distribute_lib_test.py: TestStrategyTest.testReductions_acceptStringOps (`reduce`)"""
    dist = _test_strategy()
    for op in ("mean", "MEAN", "sum", "SUM"):
        x = jnp.float32(1.0)
        assert float(dist.reduce(op, x, axis=None)) == 1.0


@run_in_and_out_of_scope
def test_reduce_mean_axis(dist):
    """distribute_lib_test.py: TestStrategyTest.testReduceMeanAxis"""
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]], jnp.float32)
    assert np.asarray(dist.reduce(ReduceOp.MEAN, x, axis=None)).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert np.asarray(dist.reduce(ReduceOp.MEAN, x, axis=0)).tolist() == [2.0, 3.0]
    assert float(dist.reduce(ReduceOp.MEAN, x, axis=(0, 1))) == 2.5


@run_in_and_out_of_scope
def test_reduce_sum_axis(dist):
    """distribute_lib_test.py: TestStrategyTest.testReduceSumAxis"""
    x = jnp.array([[1.0, 2.0], [3.0, 4.0]], jnp.float32)
    assert np.asarray(dist.reduce(ReduceOp.SUM, x, axis=None)).tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert np.asarray(dist.reduce(ReduceOp.SUM, x, axis=0)).tolist() == [4.0, 6.0]
    assert float(dist.reduce(ReduceOp.SUM, x, axis=(0, 1))) == 10.0


def test_cluster_resolver_default_not_implemented():
    """distribute_lib_test.py: TestStrategyTest.testClusterResolverDefaultNotImplemented (a
    strategy without a cluster has no cluster resolver)"""
    assert _test_strategy().cluster_resolver is None


# --- DefaultDistributionStrategyTest -----------------------------------------------------------


def test_merge_call():
    """distribute_lib_test.py: DefaultDistributionStrategyTest.testMergeCall

    TF's default replica context runs merge_fn in the cross-replica context ('foo_bar').
    Departure: README MirroredStrategy table row `merge_call` (NotImplementedError, on
    OneDeviceStrategy too; the default strategy is one)."""
    assert_in_default_state()
    replica_ctx = jaxstrategy.get_replica_context()
    assert replica_ctx.strategy is jaxstrategy.get_strategy()
    with pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
        replica_ctx.merge_call(lambda dist, s: "foo_" + s, args=("bar",))
    assert_in_default_state()


def test_scope_mostly_no_op():
    """distribute_lib_test.py: DefaultDistributionStrategyTest.testScopeMostlyNoOp

    TF: the default strategy's scope leaves the default state (has_strategy() False), and another
    strategy's scope may be entered inside it (creating a variable there is the error).
    Departure: README API table row `get_strategy()` ("the default strategy is an ordinary
    OneDeviceStrategy"): its scope is an ordinary scope, so another strategy's scope inside is the
    "Mixing different" error."""
    assert_in_default_state()
    default_strategy = jaxstrategy.get_strategy()
    scope = default_strategy.scope()
    with scope:
        assert jaxstrategy.has_strategy() and jaxstrategy.get_strategy() is default_strategy
        with pytest.raises(RuntimeError, match=r"Mixing different .*Strategy objects"):
            with _another_strategy().scope():
                pass
        with scope:
            assert jaxstrategy.get_strategy() is default_strategy
    assert_in_default_state()


def test_experimental_run_v2():
    """distribute_lib_test.py: DefaultDistributionStrategyTest.testExperimentalRunV2 (its private
    dataset iterator is the default strategy's distributed dataset)"""
    default_strategy = jaxstrategy.get_strategy()
    batches = [np.arange(i, i + 2) for i in range(0, 10, 2)]  # Dataset.range(10).batch(2)
    next_val = next(iter(default_strategy.experimental_distribute_dataset(batches)))

    def train_step(input_data):
        return input_data

    for _ in range(2):
        assert np.asarray(default_strategy.run(train_step, args=(next_val,))).tolist() == [0, 1]


def test_distributed_datasets():
    """distribute_lib_test.py: DefaultDistributionStrategyTest.testDistributedDatasets"""
    default_strategy = jaxstrategy.get_strategy()
    batches = [np.arange(i, i + 2) for i in range(0, 10, 2)]  # Dataset.range(10).batch(2)
    dist_dataset = default_strategy.experimental_distribute_dataset(batches)
    assert np.asarray(next(iter(dist_dataset))).tolist() == [0, 1]


def test_distributed_datasets_from_function():
    """distribute_lib_test.py: DefaultDistributionStrategyTest.testDistributedDatasetsFromFunction"""
    default_strategy = jaxstrategy.get_strategy()
    dist_dataset_from_func = default_strategy.distribute_datasets_from_function(
        lambda _: [np.arange(i, i + 2) for i in range(0, 10, 2)]
    )
    assert np.asarray(next(iter(dist_dataset_from_func))).tolist() == [0, 1]


def test_v2():
    """distribute_lib_test.py: DefaultDistributionStrategyTest.testV2"""
    assert isinstance(jaxstrategy.get_strategy(), jaxstrategy.Strategy)


# --- InputContextTest --------------------------------------------------------------------------


def test_input_context_properties():
    """distribute_lib_test.py: InputContextTest.testProperties"""
    input_context = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert input_context.num_replicas_in_sync == 6
    assert input_context.input_pipeline_id == 1
    assert input_context.num_input_pipelines == 2


def test_input_context_per_replica_batch_size():
    """distribute_lib_test.py: InputContextTest.testPerReplicaBatchSize"""
    input_context = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=6)
    assert input_context.get_per_replica_batch_size(12) == 2
    with pytest.raises(ValueError):
        input_context.get_per_replica_batch_size(13)


def test_input_context_str():
    """distribute_lib_test.py: InputContextTest.testStr (TF's text, with `jaxstrategy.` where TF
    writes `tf.distribute.`)"""
    input_context = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=42)
    assert str(input_context) == "jaxstrategy.InputContext(input pipeline id 0, total: 1)"
    input_context = InputContext(num_input_pipelines=3, input_pipeline_id=1, num_replicas_in_sync=42)
    assert str(input_context) == "jaxstrategy.InputContext(input pipeline id 1, total: 3)"
