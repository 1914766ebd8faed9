"""TF's two-process combination `multi_worker_mirrored_2x1_cpu`, run as a real job of two processes.

    python tests/tf_parity/two_process_worker.py OUTPUT_DIR JOB

conftest.py starts this script through `jaxstrategy.testing.run_local_workers` (two processes, one
CPU device each) once per JOB and turns each case's result into one test of the module of its TF
file. As in TF's combination, process 0 is the `chief` (task 0) and process 1 the `worker` (task 0):
the script rewrites the launcher's TF_CONFIG that way before creating the strategy.

Both processes run the cases of JOB in the same order (as any multi-worker program must), each
case in a `try`, and write what each case did to OUTPUT_DIR/JOB-process-<index>.json after every
case, so a process that dies still leaves the results before it. A case passes when it returns;
its assertions are TensorFlow's (or, for a documented departure, jaxstrategy's documented
behaviour), checked after the collectives, so that both processes reach the same collectives
whether or not a case fails. JOB `mismatched_shapes` holds the cases whose values differ in shape
between the processes (an undetected mismatch aborts both processes in gloo), so that they cannot
take the cases of JOB `main` with them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

if __name__ == "__main__":  # The package tf_parity is under tests/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jaxstrategy  # noqa: E402
from jaxstrategy import ReduceOp, get_replica_context  # noqa: E402
from tf_parity import test_strategy_test_lib as lib  # noqa: E402

Strategy = jaxstrategy.MultiWorkerMirroredStrategy


@dataclasses.dataclass(frozen=True)
class Case:
    """One TF test (method and parameters) on the two-process job.

    Attributes:
      tf_file: the TF test file, which names the module of tests/tf_parity that reports it.
      name: the TF test class, method and parameters, e.g. `GatherTest.testX[pure_eager=True]`.
      fn: runs the case in each process; returns to pass, raises to fail.
      xfail: why jaxstrategy does not match TensorFlow here (a strict xfail), or None.
      job: which job runs it.
    """

    tf_file: str
    name: str
    fn: Callable[[Strategy], None]
    xfail: str | None = None
    job: str = "main"

    @property
    def id(self) -> str:
        return f"{self.tf_file}::{self.name}"


CASES: dict[str, Case] = {}
JOBS = ("main", "mismatched_shapes")


def add(tf_file: str, name: str, fn: Callable[[Strategy], None], **kwargs: Any) -> None:
    case = Case(tf_file, name, fn, **kwargs)
    assert case.id not in CASES, case.id
    CASES[case.id] = case


def case(
    tf_file: str, name: str, **kwargs: Any
) -> Callable[[Callable[[Strategy], None]], Callable[[Strategy], None]]:
    def register(fn: Callable[[Strategy], None]) -> Callable[[Strategy], None]:
        add(tf_file, name, fn, **kwargs)
        return fn

    return register


def task_type() -> str:
    """`multi_worker_test_base.get_task_type()`: 'chief' in process 0, 'worker' in process 1."""
    return "chief" if jax.process_index() == 0 else "worker"


def local(strategy: Strategy, value: Any) -> list[Any]:
    return lib.local(strategy, value)


def expect(actual: Any, expected: Any) -> None:
    if actual != expected:
        raise AssertionError(f"expected {expected!r}, got {actual!r}")


def _with_leading_axis(value: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x)[None], value)


def stack_replicas(strategy: Strategy, value: Any) -> Any:
    """TF's `distribute.test_util.gather`: every replica's value stacked along a new axis 0, from
    every process (`gather` of each component with a leading axis added)."""
    expanded = strategy.run(_with_leading_axis, args=(value,))
    return jax.tree.map(lambda x: np.asarray(x).tolist(), strategy.gather(expanded, axis=0))


# --- strategy_test_lib.py ---------------------------------------------------------------------

LIB = "strategy_test_lib.py"
add(LIB, "DistributionTestBase._test_minimize_loss_eager", lib.check_minimize_loss_eager)
add(LIB, "DistributionTestBase._test_replica_id", lib.check_replica_id)
add(LIB, "DistributionTestBase._test_call_and_merge_exceptions[call]", lib.check_call_exceptions)
add(
    LIB,
    "DistributionTestBase._test_call_and_merge_exceptions[merge_call, departure]",
    lib.check_merge_exceptions,
)


@case(LIB, "DistributionTestBase._test_input_fn_iterable")
def _input_fn_iterable(strategy: Strategy) -> None:
    # One pipeline per process, each feeding its one replica every element of range(10).
    lib.check_input_fn_iterable(
        strategy,
        lambda: [np.int32(i) for i in range(10)],
        [[i] for i in range(10)],
        expected_num_replicas_in_sync=2,
        expected_num_input_pipelines=2,
        expected_input_pipeline_id=jax.process_index(),
    )


for _run_in_function in (False, True):
    _suffix = f"[run_in_function={_run_in_function}]"
    add(
        LIB,
        f"TwoDeviceDistributionTestBase._test_run{_suffix}",
        functools.partial(lib.check_run, run_in_function=_run_in_function),
    )
    for _name in lib.COLLECTIVES:
        add(
            LIB,
            f"TwoDeviceDistributionTestBase._test_all_reduce_{_name}{_suffix}",
            functools.partial(lib.check_two_device_collectives, name=_name, run_in_function=_run_in_function),
        )


# --- strategy_common_test.py ------------------------------------------------------------------

COMMON = "strategy_common_test.py"


@case(COMMON, "StrategyTest.testCaptureReplicaId")
def _capture_replica_id(strategy: Strategy) -> None:
    f = jax.jit(lambda: get_replica_context().replica_id_in_sync_group)
    g = jax.jit(lambda: strategy.run(f))  # TF retraces g once (a variable on its first trace).
    results = [local(strategy, g()), local(strategy, g())]
    expect(results, [[jax.process_index()]] * 2)


@case(COMMON, "StrategyTest.testMergeCallInitScope[departure]")
def _merge_call_init_scope(strategy: Strategy) -> None:
    # Departure: README MirroredStrategy table row `merge_call`.
    with strategy.scope(), pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
        strategy.run(lambda: get_replica_context().merge_call(lambda _: jnp.int32(11)) + 1)


@case(COMMON, "ReduceTest.testBasic[eager]")
def _reduce_basic(strategy: Strategy) -> None:
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda _: jnp.ones((), jnp.float32)
    )
    with strategy.scope():
        in_scope = strategy.reduce(ReduceOp.SUM, value=per_replica_value, axis=None)
    out_of_scope = strategy.reduce(ReduceOp.SUM, value=per_replica_value, axis=None)
    expect([float(in_scope), float(out_of_scope)], [2.0, 2.0])


@case(COMMON, "ReduceTest.testBasic[tf_function]")
def _reduce_basic_jit(strategy: Strategy) -> None:
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda _: jnp.ones((), jnp.float32)
    )
    fn_graph = jax.jit(lambda v: strategy.reduce(ReduceOp.SUM, value=v, axis=None))
    with strategy.scope():
        in_scope = float(fn_graph(per_replica_value))
    expect([in_scope, float(fn_graph(per_replica_value))], [2.0, 2.0])


@case(COMMON, "ReduceTest.testAxis")
def _reduce_axis(strategy: Strategy) -> None:
    x = strategy.run(jax.jit(lambda: jnp.array([1.0, 2.0], jnp.float32)))
    x_m = strategy.reduce(ReduceOp.MEAN, x, axis=0)
    x_s = strategy.reduce(ReduceOp.SUM, x, axis=0)
    expect([float(x_m), float(x_s)], [1.5, 3.0 * 2])


LOCAL_RESULTS_UNDER_JIT = r"experimental_local_results\(\): called under jax.jit"


def _dense_replica_fn() -> Any:
    return get_replica_context().all_reduce(ReduceOp.SUM, jnp.float32(1.0))


def _nested_replica_fn() -> Any:
    # IndexedSlices have no JAX counterpart: their dense values stand in for them.
    value = (
        jnp.float32(1.0),
        jnp.array([[1.0]], jnp.float32),
        jnp.float32(2.0),
        jnp.array([[2.0]], jnp.float32),
    )
    return get_replica_context().all_reduce(ReduceOp.SUM, value)


def _all_reduce_test(
    strategy: Strategy, replica_fn: Callable[[], Any], expected: Any, tf_function: bool
) -> None:
    """AllReduceTest: `fn` returns `experimental_local_results(run(replica_fn))`; TF runs it in a
    tf.function too.

    With tf_function: Departure: README MirroredStrategy table row "`experimental_local_results`
    inside `jax.jit` (`tf.function`) on several processes" (a ValueError saying to call it outside).
    """

    def fn() -> Any:
        return strategy.experimental_local_results(strategy.run(replica_fn))

    if tf_function:
        with pytest.raises(ValueError, match=LOCAL_RESULTS_UNDER_JIT):
            jax.jit(fn)()
        return
    expect(jax.tree.map(lambda x: np.asarray(x).tolist(), fn()[0]), expected)


for _tf_function in (False, True):
    _variant = "[tf_function, departure]" if _tf_function else "[no_tf_function]"
    add(
        COMMON,
        f"AllReduceTest.testDense{_variant}",
        functools.partial(
            _all_reduce_test, replica_fn=_dense_replica_fn, expected=2.0, tf_function=_tf_function
        ),
    )
    add(
        COMMON,
        f"AllReduceTest.testNestedInput{_variant}",
        functools.partial(
            _all_reduce_test,
            replica_fn=_nested_replica_fn,
            expected=(2.0, [[2.0]], 4.0, [[4.0]]),
            tf_function=_tf_function,
        ),
    )


@case(COMMON, "DistributedCollectiveAllReduceStrategyTest.testDatasetFromFunction")
def _dataset_from_function(strategy: Strategy) -> None:
    def dataset_fn(input_context: jaxstrategy.InputContext) -> Any:
        batch_size = input_context.get_per_replica_batch_size(10)

        def batches() -> Any:  # Dataset.range(100).repeat().batch(batch_size)
            i = 0
            while True:
                yield np.arange(i, i + batch_size, dtype=np.int64) % 100
                i += batch_size

        # .shard(num_input_pipelines, input_pipeline_id)
        shard = (
            b
            for k, b in enumerate(batches())
            if k % input_context.num_input_pipelines == input_context.input_pipeline_id
        )
        return shard

    with iter(strategy.distribute_datasets_from_function(dataset_fn)) as input_iterator:
        result = strategy.experimental_local_results(input_iterator.get_next())
    expect(int(np.sum(np.asarray(result))), {"chief": 10, "worker": 35}[task_type()])


@case(COMMON, "DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromDatasetLastPartialBatch")
def _simple_input_from_dataset_last_partial_batch(strategy: Strategy) -> None:
    dataset = [np.arange(0, 8), np.arange(8, 14)]  # range(14).batch(8, drop_remainder=False)
    with iter(strategy.experimental_distribute_dataset(dataset)) as input_iterator:
        strategy.run(lambda x: x, args=(next(input_iterator),))  # Let the complete batch go.
        result = strategy.run(lambda x: x, args=(next(input_iterator),))
    expect(local(strategy, result), [{"chief": [8, 9, 10], "worker": [11, 12, 13]}[task_type()]])


@case(
    COMMON,
    "DistributedCollectiveAllReduceStrategyTest.testSimpleInputFromFnLastPartialBatch",
    job="mismatched_shapes",
)
def _simple_input_from_fn_last_partial_batch(strategy: Strategy) -> None:
    """Departure: README MultiWorkerMirroredStrategy table row "processes' last batches of
    different sizes". TF gives each worker its own last batch (chief [8, 9, 10, 11], worker
    [12, 13]); one program cannot take parts of different shapes, so every process raises."""

    def dataset_fn(input_context: jaxstrategy.InputContext) -> list[np.ndarray]:
        batch_size = input_context.get_per_replica_batch_size(8)
        batches = [np.arange(i, min(i + batch_size, 14)) for i in range(0, 14, batch_size)]
        return batches[input_context.input_pipeline_id :: input_context.num_input_pipelines]

    with iter(strategy.distribute_datasets_from_function(dataset_fn)) as input_iterator:
        strategy.run(lambda x: x, args=(next(input_iterator),))  # Let the complete batch go.
        with pytest.raises(
            ValueError,
            match=r"at step 1 of this pass, the processes' batches differ in structure, shape or dtype"
            r"(.|\n)*process 0: .*\[1, 4\]\n  process 1: .*\[1, 2\]",
        ):
            next(input_iterator)


@case(COMMON, "DistributedCollectiveAllReduceStrategyTest.testReduceHostTensor")
def _reduce_host_tensor(strategy: Strategy) -> None:
    expect(float(strategy.reduce(ReduceOp.SUM, np.float32(1.0), axis=None)), 2.0)


@case(COMMON, "DistributedCollectiveAllReduceStrategyTest.testReduceDeviceTensors")
def _reduce_device_tensors(strategy: Strategy) -> None:
    value = strategy.run(lambda: jnp.float32(1.0))
    expect(float(strategy.reduce(ReduceOp.SUM, value, axis=None)), 2.0)


@case(COMMON, "StrategyClusterResolverTest.testClusterResolverProperty")
def _cluster_resolver_property(strategy: Strategy) -> None:
    resolver = strategy.cluster_resolver
    with strategy.scope():
        assert strategy.cluster_resolver is resolver
    for attribute in ("cluster_spec", "master", "num_accelerators", "task_id", "task_type"):
        assert hasattr(resolver, attribute), attribute
    expect(resolver.task_id, 0)
    assert resolver.task_type in ("chief", "worker"), resolver.task_type


# --- strategy_gather_test.py ------------------------------------------------------------------

GATHER = "strategy_gather_test.py"
SAME_SHAPE_VALUES = {
    "1D0Axis": ([1, 2, 3], 0),
    "2D0Axis": ([[1, 2, 3]], 0),
    "2D1Axis": ([[1, 2, 3]], 1),
    "3D0Axis": ([[[1, 2], [1, 2]]], 0),
    "3D1Axis": ([[[1, 2], [1, 2]]], 1),
    "3D2Axis": ([[[1, 2], [1, 2]]], 2),
}


def _gather_same_shape(strategy: Strategy, value: Any, axis: int, pure_eager: bool) -> None:
    value_on_replica = np.asarray(value, np.int32)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda _: jnp.asarray(value_on_replica)
    )
    run = functools.partial(strategy.gather, axis=axis)
    if not pure_eager:
        run = jax.jit(run)
    expected = np.concatenate([value_on_replica] * 2, axis=axis).tolist()
    expect(np.asarray(run(distributed_values)).tolist(), expected)


def _all_gather_same_shape(strategy: Strategy, value: Any, axis: int, pure_eager: bool, dtype: Any) -> None:
    value_on_replica = np.asarray(value, dtype)
    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda _: jnp.asarray(value_on_replica)
    )

    def replica_fn(per_replica_value: Any) -> Any:
        return get_replica_context().all_gather(per_replica_value, axis=axis)

    fn = replica_fn if pure_eager else jax.jit(replica_fn)
    result = local(strategy, strategy.run(fn, args=(per_replica_value,)))
    expect(result, [np.concatenate([value_on_replica] * 2, axis=axis).tolist()])


for _pure_eager in (True, False):
    _p = f"[pure_eager={_pure_eager}]"
    for _shape, (_value, _axis) in SAME_SHAPE_VALUES.items():
        add(
            GATHER,
            f"GatherTest.testGatherPerReplicaDense{_shape}{_p}",
            functools.partial(_gather_same_shape, value=_value, axis=_axis, pure_eager=_pure_eager),
        )
        add(
            GATHER,
            f"GatherTest.testAllGatherPerReplicaDense{_shape}{_p}",
            functools.partial(
                _all_gather_same_shape,
                value=_value,
                axis=_axis,
                pure_eager=_pure_eager,
                dtype=np.float32 if _shape == "1D0Axis" else np.int32,
            ),
        )

    def _all_gather_nest_1d0(strategy: Strategy, pure_eager: bool = _pure_eager) -> None:
        single_value = jnp.array([1, 2, 3], jnp.int32)

        def run() -> Any:
            return get_replica_context().all_gather([single_value, single_value], axis=0)

        result = strategy.run(run if pure_eager else jax.jit(run))
        for gathered_result in result:
            expect(local(strategy, gathered_result), [[1, 2, 3, 1, 2, 3]])

    add(GATHER, f"GatherTest.testAllGatherNest1D0Axis{_p}", _all_gather_nest_1d0)


def _all_gather_gradient(strategy: Strategy, nest: bool) -> None:
    # Replica r's c is r + 1; the gradient of all_gather sums every replica's upstream gradient.
    def step(c: jax.Array) -> jax.Array:
        x = jnp.array([[3.0], [5.0]], jnp.float32)
        y = jnp.array([[2.0], [4.0]], jnp.float32)

        def total(x: jax.Array) -> jax.Array:
            if nest:
                mid = jnp.stack(get_replica_context().all_gather([x, y], 1))
            else:
                mid = get_replica_context().all_gather(x, 1)
            return jnp.sum(mid * c)

        return jax.grad(total)(x)

    per_replica_value = strategy.experimental_distribute_values_from_function(
        lambda ctx: jnp.array([[1.0, 2.0][ctx.replica_id_in_sync_group]], jnp.float32)
    )
    result = local(strategy, strategy.run(jax.jit(step), args=(per_replica_value,)))
    expect(result, [[[3.0], [3.0]]])


add(
    GATHER,
    "GatherTest.testAllGatherGradient[pure_eager=False]",
    functools.partial(_all_gather_gradient, nest=False),
)
add(
    GATHER,
    "GatherTest.testAllGatherGradientNest[pure_eager=False]",
    functools.partial(_all_gather_gradient, nest=True),
)


# Values whose shapes differ between the processes: the job "mismatched_shapes", so that a failure
# to detect the mismatch (which aborts both processes in gloo) cannot take the other cases with it.
DIFFERENT_SHAPES_ERROR = r"differ between processes in structure, shape or dtype"


def _gather_diff_shape(strategy: Strategy, axis: int, pure_eager: bool, all_gather: bool) -> None:
    """TF concatenates the replicas' values of different shapes ([1, 1] and [2, 1] -> [3, 1] along
    axis 0; [1, 1] and [1, 2] -> [1, 3] along axis 1). Departure: README MirroredStrategy table row
    "per-replica values of different shapes" (a ValueError listing the shapes, here each
    process's), raised before any collective."""
    del pure_eager, all_gather  # The error comes before gather or all_gather is reached.
    shape = (lambda i: (i + 1, 1)) if axis == 0 else (lambda i: (1, i + 1))
    with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
        strategy.experimental_distribute_values_from_function(
            lambda ctx: jnp.ones(shape(ctx.replica_id_in_sync_group), jnp.int32)
        )


def _gather_raises(strategy: Strategy, pure_eager: bool, all_gather: bool, different_rank: bool) -> None:
    """TF raises (InvalidArgumentError 'Shape mismatch' on MWMS); here a ValueError, before any
    collective: experimental_distribute_values_from_function compares the processes' shapes."""

    def value_fn(ctx: jaxstrategy.ValueContext) -> jax.Array:
        if different_rank:  # [1], [1, 2]
            return jnp.ones(tuple(range(1, ctx.replica_id_in_sync_group + 2)), jnp.float32)
        return jnp.ones((1, ctx.replica_id_in_sync_group + 1), jnp.int32)  # [1, 1], [1, 2]

    def gather(value: Any) -> Any:
        return get_replica_context().all_gather(value, axis=0)

    with pytest.raises(ValueError, match=DIFFERENT_SHAPES_ERROR):
        per_replica_value = strategy.experimental_distribute_values_from_function(value_fn)
        if all_gather:
            strategy.run(gather if pure_eager else jax.jit(gather), args=(per_replica_value,))
        else:
            run = functools.partial(strategy.gather, axis=0)
            np.asarray((run if pure_eager else jax.jit(run))(per_replica_value))


for _pure_eager in (True, False):
    _p = f"[pure_eager={_pure_eager}]"
    for _all_gather in (False, True):
        _method = "testAllGather" if _all_gather else "testGather"
        for _axis in (0, 1):
            add(
                GATHER,
                f"GatherTest.{_method}DiffShapeAtAxis{_axis}{_p}[departure]",
                functools.partial(
                    _gather_diff_shape, axis=_axis, pure_eager=_pure_eager, all_gather=_all_gather
                ),
                job="mismatched_shapes",
            )
        for _rank, _what in ((False, "DiffShapeAtNonAxis"), (True, "DifferentRank")):
            add(
                GATHER,
                f"GatherTest.{_method}Raise{_what}{_p}",
                functools.partial(
                    _gather_raises, pure_eager=_pure_eager, all_gather=_all_gather, different_rank=_rank
                ),
                job="mismatched_shapes",
            )

    add(
        GATHER,
        f"GatherTest.testAllGatherNest{_p}[departure]",  # Its first value is testAllGatherDiffShapeAtAxis1's.
        functools.partial(_gather_diff_shape, axis=1, pure_eager=_pure_eager, all_gather=True),
        job="mismatched_shapes",
    )


# --- input_lib_test.py ------------------------------------------------------------------------

INPUT = "input_lib_test.py"


def _assert_iteration(
    strategy: Strategy, dataset: Any, expected_values: list[list[Any]], iteration_type: str
) -> None:
    """input_lib_test.py: DistributedIteratorTestBase._test_input_iteration (wrap_into_dataset)."""
    if iteration_type == "for_loop":
        actual = [local(strategy, x) for x in dataset]
        expect(actual, expected_values)
        return
    with iter(dataset) as iterator:
        expect([local(strategy, iterator.get_next()) for _ in expected_values], expected_values)
        with pytest.raises(jaxstrategy.OutOfRangeError):
            iterator.get_next()
    with iter(dataset) as iterator:  # Re-initializing: a new pass.
        expect([local(strategy, iterator.get_next()) for _ in expected_values], expected_values)
    with iter(dataset) as iterator:
        expect(
            [local(strategy, iterator.get_next_as_optional().get_value()) for _ in expected_values],
            expected_values,
        )
        next_element = iterator.get_next_as_optional()
        assert not next_element.has_value()
        with pytest.raises(ValueError):  # TF: InvalidArgumentError
            iterator.get_next_as_optional().get_value()


for _iteration_type in ("get_next", "for_loop"):

    def _one_device_cpu_multi_worker(strategy: Strategy, iteration_type: str = _iteration_type) -> None:
        dataset = strategy.distribute_datasets_from_function(lambda _: [np.int64(i) for i in range(10)])
        _assert_iteration(strategy, dataset, [[i] for i in range(10)], iteration_type)

    def _uneven_batches_dataset(strategy: Strategy, iteration_type: str = _iteration_type) -> None:
        # range(9).batch(2, drop_remainder=True): each process keeps its replica's half.
        dataset = strategy.experimental_distribute_dataset([np.arange(i, i + 2) for i in range(0, 8, 2)])
        first = jax.process_index()
        _assert_iteration(strategy, dataset, [[[i + first]] for i in range(0, 8, 2)], iteration_type)

    add(
        INPUT,
        f"DistributedIteratorTest.testOneDeviceCPUMultiWorker[input_fn][{_iteration_type}]",
        _one_device_cpu_multi_worker,
    )
    add(
        INPUT,
        f"DistributedIteratorTest.testUnevenDatasetBatchesMultiWorker[dataset][drop_remainder=True][{_iteration_type}]",
        _uneven_batches_dataset,
    )


@case(INPUT, "DistributedIteratorTest.testIterableIterator")
def _iterable_iterator(strategy: Strategy) -> None:
    dist_dataset = strategy.distribute_datasets_from_function(lambda _: [np.int64(i) for i in range(10)])
    iterator = iter(dist_dataset)
    seen = [local(strategy, element) for element in iterator]
    expect(seen, [[i] for i in range(10)])


@case(INPUT, "DistributedIteratorTest.testUnevenDatasetBatchesMultiWorker[input_fn][departure]")
def _uneven_batches_input_fn(strategy: Strategy) -> None:
    # Departure: README MirroredStrategy table row "distribute_datasets_from_function with elements
    # left over for fewer than all replicas", and the multi-worker "Input." paragraph: where the
    # processes' inputs end at different steps, every process ends the pass at the first such step,
    # with a warning. TF instead gives the worker an empty batch at step 5.
    def dataset_fn(ctx: jaxstrategy.InputContext) -> list[np.ndarray]:
        # range(9).shard(2, id).batch(1)
        return [np.array([i]) for i in range(9)[ctx.input_pipeline_id :: ctx.num_input_pipelines]]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = [local(strategy, x) for x in strategy.distribute_datasets_from_function(dataset_fn)]
    first = jax.process_index()
    expect(seen, [[[i + first]] for i in range(0, 8, 2)])
    messages = [str(w.message) for w in caught]
    assert any("ended at step 4" in m for m in messages), messages


@case(
    INPUT,
    "DistributedIteratorTest.testUnevenDatasetBatchesMultiWorker[dataset][drop_remainder=False][departure]",
)
def _uneven_batches_dataset_partial(strategy: Strategy) -> None:
    # Departure: README MirroredStrategy table row "a global batch the replicas do not divide": an
    # error by default (TF gives the worker an empty batch). range(9).batch(2).
    dataset = strategy.experimental_distribute_dataset([np.arange(i, min(i + 2, 9)) for i in range(0, 9, 2)])
    seen = []
    with pytest.raises(
        ValueError, match=r"got a batch of 1 examples, which does not split evenly over 2 replicas"
    ):
        for x in dataset:
            seen.append(local(strategy, x))
    expect(seen, [[[i + jax.process_index()]] for i in range(0, 8, 2)])


@case(INPUT, "DistributedIteratorTest.testCacheAcrossIteration")
def _cache_across_iteration(strategy: Strategy) -> None:
    # Dataset.range(16).shuffle(16).cache().batch(4): shuffled once (the same seed in every
    # process, as TF's shuffle is seeded per job), then read from the cache.
    cached = np.random.default_rng(7).permutation(16).reshape(4, 4)
    dist_dataset = strategy.experimental_distribute_dataset(list(cached))
    first_epoch = [local(strategy, x) for x in dist_dataset]
    second_epoch = [local(strategy, x) for x in dist_dataset]
    expect(first_epoch, second_epoch)


class ShuffledRange:
    """`Dataset.range(n).shuffle(n, reshuffle_each_iteration=...).batch(batch)`: each pass (each
    `iter()`) draws the next permutation when reshuffling, else the same one."""

    def __init__(self, n: int, batch: int, reshuffle: bool, seed: int = 0):
        self._rng = np.random.default_rng(seed)
        self._n, self._batch, self._reshuffle = n, batch, reshuffle
        self._fixed = self._rng.permutation(n)

    def __iter__(self) -> Any:
        order = self._rng.permutation(self._n) if self._reshuffle else self._fixed
        return iter(list(order.reshape(-1, self._batch)))


for _reshuffle in (True, False):

    def _shuffle_across_iterations(strategy: Strategy, reshuffle: bool = _reshuffle) -> None:
        dist_dataset = strategy.experimental_distribute_dataset(ShuffledRange(12, 4, reshuffle))
        first_epoch = [local(strategy, x) for x in dist_dataset]
        second_epoch = [local(strategy, x) for x in dist_dataset]
        assert (first_epoch != second_epoch) == reshuffle, (first_epoch, second_epoch)

    add(
        INPUT,
        f"DistributedIteratorTest.testShuffleAcrossIterations[reshuffle={_reshuffle}]",
        _shuffle_across_iterations,
    )


@case(INPUT, "DistributedIteratorTest.testGetNextOptionalShape")
def _get_next_optional_shape(strategy: Strategy) -> None:
    batch_size = 8
    dataset = [{"feature": np.ones([batch_size, 10], np.float32), "label": np.ones([batch_size], np.float32)}]
    per_replica_batch_size = batch_size // strategy.num_replicas_in_sync
    shapes = []
    for data in strategy.experimental_distribute_dataset(dataset):
        for replica in strategy.experimental_local_results(data):
            shapes.append((replica["feature"].shape, replica["label"].shape))
    expect(shapes, [((per_replica_batch_size, 10), (per_replica_batch_size,))])


@case(INPUT, "DistributedIteratorTest.testDifferentDatasetsMultiWorker[input_fn][departure]")
def _different_datasets(strategy: Strategy) -> None:
    # Departure: as testUnevenDatasetBatchesMultiWorker[input_fn]: pipeline 0 has 4 batches and
    # pipeline 1 has 5; TF gives the chief an empty batch at step 5, jaxstrategy ends both at step 4.
    def dataset_fn(ctx: jaxstrategy.InputContext) -> list[np.ndarray]:
        n = 8 if ctx.input_pipeline_id == 0 else 9  # Dataset.range(n).batch(2)
        return [np.arange(i, min(i + 2, n)) for i in range(0, n, 2)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = [local(strategy, x) for x in strategy.distribute_datasets_from_function(dataset_fn)]
    expect(seen, [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]])
    messages = [str(w.message) for w in caught]
    assert any("ended at step 4" in m for m in messages), messages


@case(INPUT, "DistributedIteratorTest.testLoopOverDatasetInTFFunction")
def _loop_over_dataset(strategy: Strategy) -> None:
    # range(10).map(lambda x: {"y": x ** 2}).batch(4); TF sums into a SUM-aggregated variable.
    squares = np.arange(10, dtype=np.float32) ** 2
    dataset = [{"y": squares[i : i + 4]} for i in range(0, 10, 4)]

    def step(data: Any) -> Any:
        return get_replica_context().all_reduce(ReduceOp.SUM, jnp.sum(data["y"]))

    v = 0.0
    for data in strategy.experimental_distribute_dataset(dataset):
        v += float(strategy.run(step, args=(data,)))
    expect(v, 285.0)


# --- values_test.py ---------------------------------------------------------------------------

VALUES = "values_test.py"


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueFromTensor")
def _from_tensor(strategy: Strategy) -> None:
    single_value = jnp.int32(1)
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: single_value)
    expect(stack_replicas(strategy, distributed_values), [1, 1])


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueSingleNumpyArrayConstant")
def _numpy_array_constant(strategy: Strategy) -> None:
    array_value = np.array([1.0, 2.0, 3.0])
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: array_value)
    expect(stack_replicas(strategy, distributed_values), [[1.0, 2.0, 3.0]] * 2)


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueTupleConstant")
def _tuple_constant(strategy: Strategy) -> None:
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: (1.0, 2.0, 3.0))
    expect(stack_replicas(strategy, distributed_values), ([1.0, 1.0], [2.0, 2.0], [3.0, 3.0]))


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueNestedStructurePerReplica")
def _nested_structure(strategy: Strategy) -> None:
    def value_fn(ctx: jaxstrategy.ValueContext) -> tuple[float, ...]:
        return tuple(val * ctx.replica_id_in_sync_group for val in (1.0, 2.0, 3.0))

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    expect(stack_replicas(strategy, distributed_values), ([0.0, 1.0], [0.0, 2.0], [0.0, 3.0]))


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueExtractFromArray")
def _extract_from_array(strategy: Strategy) -> None:
    multiple_values = range(strategy.num_replicas_in_sync)
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group]
    )
    expect(stack_replicas(strategy, distributed_values), [0, 1])


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueAndRun")
def _and_run(strategy: Strategy) -> None:
    """Departure: README MultiWorkerMirroredStrategy table row "`experimental_distribute_values_from_function`
    inside `jax.jit`". TF builds the values, runs and gathers inside one tf.function; across
    processes here the values are made outside jax.jit, and run and gather inside."""

    def build() -> Any:
        multiple_values = range(strategy.num_replicas_in_sync)
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: multiple_values[ctx.replica_id_in_sync_group]
        )

    with pytest.raises(ValueError, match=r"called under jax.jit on a strategy of several processes"):
        jax.jit(build)()

    @jax.jit
    def run(distributed_values: Any) -> Any:
        outputs = strategy.run(lambda x: jnp.square(x)[None], args=(distributed_values,))
        return strategy.gather(outputs, axis=0)

    expect(np.asarray(run(build())).tolist(), [0, 1])


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueDefaultDevicePlacement")
def _default_device_placement(strategy: Strategy) -> None:
    # One device per process: the component stays on the process's (default) CPU device.
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: jnp.float32(1.0))
    devices = [v.devices() for v in strategy.experimental_local_results(distributed_values)]
    expect(devices, [{jax.local_devices()[0]}])


@case(VALUES, "DistributedValuesTest.testMakeDistributedValueExplicitDevicePlacement")
def _explicit_device_placement(strategy: Strategy) -> None:
    worker_devices = jax.local_devices()  # TF's extended.worker_devices: this worker's devices.

    def value_fn(ctx: jaxstrategy.ValueContext) -> jax.Array:
        worker_device_id = ctx.replica_id_in_sync_group % len(worker_devices)
        return jax.device_put(jnp.float32(1.0), worker_devices[worker_device_id])

    distributed_values = strategy.experimental_distribute_values_from_function(value_fn)
    devices = [v.devices() for v in strategy.experimental_local_results(distributed_values)]
    expect(devices, [{d} for d in worker_devices])


# --- the job ----------------------------------------------------------------------------------


def _as_chief_or_worker() -> None:
    """Rewrite the launcher's TF_CONFIG (two workers) as TF's 2x1 combination: a chief and a worker."""
    tf_config = json.loads(os.environ["TF_CONFIG"])
    first, second = tf_config["cluster"]["worker"]
    index = tf_config["task"]["index"]
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"chief": [first], "worker": [second]},
            "task": {"type": "chief" if index == 0 else "worker", "index": 0},
        }
    )


def main(output_dir: Path, job: str) -> None:
    _as_chief_or_worker()
    jax.config.update("jax_numpy_dtype_promotion", "strict")  # As the test session has it.
    jaxstrategy.MultiWorkerMirroredStrategy()  # Joins the job.
    warnings.simplefilter("error")  # As pytest's filterwarnings = error.
    path = output_dir / f"{job}-process-{jax.process_index()}.json"
    results: dict[str, dict[str, Any]] = {}
    for case_id, registered in CASES.items():
        if registered.job != job:
            continue
        started = time.monotonic()
        try:
            # A strategy per case, as TF's combinations give each test its own: it joins the job
            # already running, and its compile cache starts empty. A process whose input stalls
            # fails within the job's timeout instead of after an hour.
            registered.fn(jaxstrategy.MultiWorkerMirroredStrategy(input_timeout_seconds=30))
            outcome: dict[str, Any] = {"ok": True}
        except Exception as error:  # noqa: BLE001 - reported, then the next case runs
            outcome = {"ok": False, "error": "".join(traceback.format_exception(error))[-3000:]}
        outcome["seconds"] = round(time.monotonic() - started, 3)
        results[case_id] = outcome
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(results, indent=1))
        partial.replace(path)
    print(f"tf_parity: {sum(r['ok'] for r in results.values())} of {len(results)} cases passed", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
