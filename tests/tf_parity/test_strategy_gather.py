"""strategy_gather_test.py: GatherTest (`strategy.gather` and `ReplicaContext.all_gather`), on TF's
default, one-device and mirrored stand-ins (combinations.py) and on `multi_worker_mirrored_2x1_cpu`
(a real job of two processes, cases in two_process_worker.py).

TF's `pure_eager=False` runs the function in a tf.function; here in jax.jit, with the distributed
value passed as an argument (JAX does not let a compiled function close over arrays that span
other processes' devices). `tf.gradients` becomes `jax.grad`.

Skipped, as TF internals:
- testGatherRaiseSparse, testAllGatherRaiseSparse: `tf.IndexedSlices`, which JAX has no
  counterpart of.
- testAllGatherDiffValueTPU: TPU only.
- The central-storage, TPU and GPU combinations (their one- and two-device behaviour runs on the
  CPU stand-ins).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstrategy import RunOptions, get_replica_context
from tf_parity import combinations as c
from tf_parity.test_strategy_test_lib import local

TF_FILE = "strategy_gather_test.py"
STRATEGIES = [
    c.default_strategy,
    c.one_device_strategy_gpu,
    c.mirrored_strategy_with_one_cpu,
    c.mirrored_strategy_with_two_cpus,
]
PURE_EAGER = pytest.mark.parametrize("pure_eager", [True, False], ids=["pure_eager", "tf_function"])
SAME_SHAPE = pytest.mark.parametrize(
    ("value", "axis"),
    [
        ([1, 2, 3], 0),
        ([[1, 2, 3]], 0),
        ([[1, 2, 3]], 1),
        ([[[1, 2], [1, 2]]], 0),
        ([[[1, 2], [1, 2]]], 1),
        ([[[1, 2], [1, 2]]], 2),
    ],
    ids=["Dense1D0Axis", "Dense2D0Axis", "Dense2D1Axis", "Dense3D0Axis", "Dense3D1Axis", "Dense3D2Axis"],
)
ON_STRATEGIES = pytest.mark.parametrize("distribution", STRATEGIES, indirect=True, ids=str)
DIFFERENT_SHAPES_ERROR = r"same shape and dtype on every replica"
SEVERAL_REPLICAS = pytest.mark.parametrize(
    "distribution", [s for s in STRATEGIES if s.num_replicas > 1], indirect=True, ids=str
)


def _all_gather(value, *, axis):
    return get_replica_context().all_gather(value, axis=axis)


def _run_all_gather(distribution, value, axis, pure_eager):
    fn = _all_gather if pure_eager else jax.jit(_all_gather, static_argnames="axis")
    options = RunOptions(static_argnames="axis")
    return distribution.run(fn, args=(value,), kwargs={"axis": axis}, options=options)


def _gather(distribution, value, axis, pure_eager):
    run = functools.partial(distribution.gather, axis=axis)
    return (run if pure_eager else jax.jit(run))(value)


def _per_replica(distribution, shape_of_replica, dtype=jnp.int32):
    return distribution.experimental_distribute_values_from_function(
        lambda ctx: jnp.ones(shape_of_replica(ctx.replica_id_in_sync_group), dtype)
    )


# --- gather ------------------------------------------------------------------------------------


@ON_STRATEGIES
@PURE_EAGER
@SAME_SHAPE
def test_gather_per_replica(distribution, pure_eager, value, axis):
    """strategy_gather_test.py: GatherTest.testGatherPerReplica<Dense...> (the id names the method)
    and _gather_same_shape_and_verify"""
    value_on_replica = jnp.array(value, jnp.int32)
    distributed_values = distribution.experimental_distribute_values_from_function(lambda _: value_on_replica)
    expected = np.concatenate([np.asarray(value)] * distribution.num_replicas_in_sync, axis=axis)
    assert (
        np.asarray(_gather(distribution, distributed_values, axis, pure_eager)).tolist() == expected.tolist()
    )


@pytest.mark.parametrize("axis", [0, 1], ids=["testGatherDiffShapeAtAxis0", "testGatherDiffShapeAtAxis1"])
@ON_STRATEGIES
@PURE_EAGER
def test_gather_diff_shape_at_axis(distribution, pure_eager, axis):
    """strategy_gather_test.py: GatherTest.testGatherDiffShapeAtAxis0 and testGatherDiffShapeAtAxis1
    (the id names the method): replica r's value has r + 1 rows (axis 0) or columns (axis 1), and
    TF concatenates them ([1, 1] and [2, 1] -> [3, 1]; [1, 1] and [1, 2] -> [1, 3]).

    With one replica, as TF. With several: Departure: README MirroredStrategy table row
    "per-replica values of different shapes" (a ValueError listing each replica's shape)."""
    shape = (lambda r: (r + 1, 1)) if axis == 0 else (lambda r: (1, r + 1))
    if distribution.num_replicas_in_sync > 1:
        with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
            _per_replica(distribution, shape)
        return
    distributed_values = _per_replica(distribution, shape)
    expected = np.ones((1, 1), np.int32)
    assert (
        np.asarray(_gather(distribution, distributed_values, axis, pure_eager)).tolist() == expected.tolist()
    )


@SEVERAL_REPLICAS
@PURE_EAGER
@pytest.mark.parametrize(
    "different_rank", [False, True], ids=["testGatherRaiseDiffShapeAtNonAxis", "testGatherRaiseDifferentRank"]
)
def test_gather_raise(distribution, pure_eager, different_rank):
    """strategy_gather_test.py: GatherTest.testGatherRaiseDiffShapeAtNonAxis ([1, 1], [1, 2] along
    axis 0) and testGatherRaiseDifferentRank ([1], [1, 2]); the id names the method.

    TF raises (InvalidArgumentError or ValueError, with its shape-inference message); here the
    ValueError comes from experimental_distribute_values_from_function, which needs one shape."""
    shape = (lambda r: tuple(range(1, r + 2))) if different_rank else (lambda r: (1, r + 1))
    with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
        distributed_values = _per_replica(distribution, shape, jnp.float32 if different_rank else jnp.int32)
        _gather(distribution, distributed_values, 0, pure_eager)


# --- all_gather --------------------------------------------------------------------------------


@ON_STRATEGIES
@PURE_EAGER
@SAME_SHAPE
def test_all_gather_per_replica(distribution, pure_eager, value, axis):
    """strategy_gather_test.py: GatherTest.testAllGatherPerReplica<Dense...> (the id names the
    method) and _all_gather_same_shape_and_verify"""
    value_on_replica = jnp.array(value, jnp.float32 if np.ndim(value) == 1 else jnp.int32)
    per_replica_value = distribution.experimental_distribute_values_from_function(lambda _: value_on_replica)
    result = local(distribution, _run_all_gather(distribution, per_replica_value, axis, pure_eager))
    n = distribution.num_replicas_in_sync
    expect = np.concatenate([np.asarray(value)] * n, axis=axis).tolist()
    assert result == [expect] * n


@pytest.mark.parametrize(
    "axis", [0, 1], ids=["testAllGatherDiffShapeAtAxis0", "testAllGatherDiffShapeAtAxis1"]
)
@ON_STRATEGIES
@PURE_EAGER
def test_all_gather_diff_shape_at_axis(distribution, pure_eager, axis):
    """strategy_gather_test.py: GatherTest.testAllGatherDiffShapeAtAxis0 and
    testAllGatherDiffShapeAtAxis1 (the id names the method; shapes as in the gather tests)

    With one replica, as TF. With several: Departure: README MirroredStrategy table row
    "per-replica values of different shapes" (a ValueError listing each replica's shape)."""
    shape = (lambda r: (r + 1, 1)) if axis == 0 else (lambda r: (1, r + 1))
    if distribution.num_replicas_in_sync > 1:
        with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
            _per_replica(distribution, shape)
        return
    per_replica_value = _per_replica(distribution, shape)
    result = local(distribution, _run_all_gather(distribution, per_replica_value, axis, pure_eager))
    assert result == [np.ones((1, 1), np.int32).tolist()]


@ON_STRATEGIES
@PURE_EAGER
def test_all_gather_nest(distribution, pure_eager):
    """strategy_gather_test.py: GatherTest.testAllGatherNest (replica r's first value is [1, r + 1])

    With one replica, as TF. With several: Departure: README MirroredStrategy table row
    "per-replica values of different shapes" (a ValueError listing each replica's shape)."""
    axis = 1
    if distribution.num_replicas_in_sync > 1:
        with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
            _per_replica(distribution, lambda r: (1, r + 1))
        return
    per_replica_value = _per_replica(distribution, lambda r: (1, r + 1))
    value_2 = jnp.array([[[1, 2], [1, 2]]], jnp.int32)
    result = _run_all_gather(distribution, [per_replica_value, value_2], axis, pure_eager)
    assert local(distribution, result[0]) == [[[1]]]
    assert local(distribution, result[1]) == [np.asarray(value_2).tolist()]


@ON_STRATEGIES
@PURE_EAGER
def test_all_gather_nest_1d0_axis(distribution, pure_eager):
    """strategy_gather_test.py: GatherTest.testAllGatherNest1D0Axis"""
    single_value = jnp.array([1, 2, 3], jnp.int32)

    def run():
        return get_replica_context().all_gather([single_value, single_value], axis=0)

    n = distribution.num_replicas_in_sync
    result = distribution.run(run if pure_eager else jax.jit(run))
    assert len(result) == 2
    for gathered_result in result:
        assert local(distribution, gathered_result) == [[1, 2, 3] * n] * n


@SEVERAL_REPLICAS
@PURE_EAGER
@pytest.mark.parametrize(
    "different_rank",
    [False, True],
    ids=["testAllGatherRaiseDiffShapeAtNonAxis", "testAllGatherRaiseDifferentRank"],
)
def test_all_gather_raise(distribution, pure_eager, different_rank):
    """strategy_gather_test.py: GatherTest.testAllGatherRaiseDiffShapeAtNonAxis and
    testAllGatherRaiseDifferentRank (the id names the method).

    TF raises (InvalidArgumentError or ValueError, with its shape-inference message); here the
    ValueError comes from experimental_distribute_values_from_function, which needs one shape."""
    shape = (lambda r: tuple(range(1, r + 2))) if different_rank else (lambda r: (1, r + 1))
    with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
        per_replica_value = _per_replica(distribution, shape, jnp.float32 if different_rank else jnp.int32)
        _run_all_gather(distribution, per_replica_value, 0, pure_eager)


def _gradient_step(c, *, nest):
    """d sum(all_gather(x, axis=1) * c) / dx, x = [[3.], [5.]] (with `nest`, all_gather([x, y]))."""
    x = jnp.array([[3.0], [5.0]], jnp.float32)
    y = jnp.array([[2.0], [4.0]], jnp.float32)

    def total(x):
        if nest:
            mid = jnp.stack(get_replica_context().all_gather([x, y], 1))
        else:
            mid = get_replica_context().all_gather(x, 1)
        return jnp.sum(mid * c)

    return jax.grad(total)(x)


@ON_STRATEGIES
@pytest.mark.parametrize("nest", [False, True], ids=["testAllGatherGradient", "testAllGatherGradientNest"])
def test_all_gather_gradient(distribution, nest):
    """strategy_gather_test.py: GatherTest.testAllGatherGradient and testAllGatherGradientNest (the
    id names the method; TF skips pure_eager, where tf.gradients needs a tf.function)

    Replica r multiplies the gathered value by c_r = r + 1; the gradient of all_gather carries the
    sum of every replica's upstream gradient, sum(c) on every replica."""
    per_replica_value = distribution.experimental_distribute_values_from_function(
        lambda ctx: jnp.array([[1.0, 2.0, 3.0, 4.0][ctx.replica_id_in_sync_group]], jnp.float32)
    )
    step = jax.jit(_gradient_step, static_argnames="nest")
    result = distribution.run(
        step, args=(per_replica_value,), kwargs={"nest": nest}, options=RunOptions(static_argnames="nest")
    )
    n = distribution.num_replicas_in_sync
    gradient_comp = float(sum(range(1, n + 1)))
    assert local(distribution, result) == [[[gradient_comp], [gradient_comp]]] * n


# --- multi_worker_mirrored_2x1_cpu ------------------------------------------------------------


def test_two_process(two_process_case):
    """strategy_gather_test.py on multi_worker_mirrored_2x1_cpu, a real job of two processes (chief
    and worker); the case id names the TF test (see two_process_worker.py)."""
    two_process_case.check()
