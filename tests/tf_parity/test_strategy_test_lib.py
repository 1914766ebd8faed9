"""strategy_test_lib.py: TF's library of checks every strategy must pass, and those checks run here.

The `check_*` functions translate the `_test_*` methods of `DistributionTestBase`,
`OneDeviceDistributionTestBase` and `TwoDeviceDistributionTestBase`; their expectations are
written for this process's replicas, so they hold in every process of a multi-process job too.
test_one_device_strategy.py and test_mirrored_strategy.py call them for TF's own test methods on
TF's strategies there (one device on '/cpu:0' and '/cpu:1', mirrored on one and two devices); this
module runs them on the strategies those do not cover: the default strategy, MirroredStrategy on
'/cpu:1' and '/cpu:2' and on four devices, MultiWorkerMirroredStrategy alone in this process, and
(through two_process_worker.py) MultiWorkerMirroredStrategy as a real job of two processes.

TF's input pipelines (`make_input_fn_iterator`, `Dataset.from_tensors/from_tensor_slices`) become
`distribute_datasets_from_function` over Python lists, whose grouping is TF's input_fn grouping:
consecutive elements to consecutive replicas. `tf.function` becomes `jax.jit`; `tf.gradients` and
`GradientTape` become `jax.grad` and `jax.vjp`.

Skipped from strategy_test_lib.py, as TF internals:
- `_test_minimize_loss_graph`, `_test_numpy_dataset`, `_test_input_fn_iterator`: graph mode,
  Sessions and TF1 iterators (`make_input_fn_iterator`, `experimental_make_numpy_dataset`).
- `_test_summary_for_replica_zero_only`: tf.summary writers; jaxstrategy has no summaries.
- `_test_global_step_update`, `_test_trainable_variable`: variable aggregation (ONLY_FIRST_REPLICA)
  and synchronization (ON_READ) of tf.Variables.
- `_test_device_and_input_device_are_colocated(_with_function)`: graph-mode Sessions on an
  in-process remote cluster.
- `RemoteSingleWorkerMirroredStrategyBase`: graph mode against a remote worker's GPUs
  (`_testDeviceScope`, `_testMakeInputFnIterator*`); its `_testMinimizeLoss` is
  `check_minimize_loss_eager`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import get_replica_context
from tf_parity import combinations as c
from tf_parity.combinations import local_replica_ids

TF_FILE = "strategy_test_lib.py"


class _TestException(Exception):
    pass


def _raise_exception_fn(_: Any = None) -> None:
    raise _TestException()


def _merge_raises_fn() -> None:
    get_replica_context().merge_call(_raise_exception_fn)


def _call_raises_fn(dist: Any) -> None:
    dist.run(_raise_exception_fn)


def _merge_call_raises_fn() -> None:
    get_replica_context().merge_call(_call_raises_fn)


def _call_merge_raises_fn(dist: Any) -> None:
    dist.run(_merge_raises_fn)


def _merge_call_merge_raises_fn() -> None:
    get_replica_context().merge_call(_call_merge_raises_fn)


def _all_sum(value: Any) -> Any:
    return get_replica_context().all_reduce(jaxstrategy.ReduceOp.SUM, value)


def _all_mean(value: Any) -> Any:
    return get_replica_context().all_reduce(jaxstrategy.ReduceOp.MEAN, value)


def _maybe_run_in_function(fn: Callable[..., Any], run_in_function: bool) -> Callable[..., Any]:
    """TF wraps the replica function in tf.function; here in jax.jit."""
    return jax.jit(fn) if run_in_function else fn


def local(strategy: jaxstrategy.Strategy, value: Any) -> list[Any]:
    """`strategy.experimental_local_results(value)` as Python lists/numbers (TF's `evaluate(unwrap)`)."""
    return [
        jax.tree.map(lambda x: np.asarray(x).tolist(), v) for v in strategy.experimental_local_results(value)
    ]


def mine(strategy: jaxstrategy.Strategy, per_replica: Sequence[Any]) -> list[Any]:
    """The entries of a list indexed by replica id that belong to this process's replicas."""
    return [per_replica[i] for i in local_replica_ids(strategy)]


def _this_pipelines_part(elements: Sequence[Any], ctx: jaxstrategy.InputContext) -> list[Any]:
    """One step's per-replica elements, as the pipeline `ctx` feeds them: all of them with one
    pipeline (one process), else this process's consecutive block."""
    per_pipeline = len(elements) // ctx.num_input_pipelines
    start = ctx.input_pipeline_id * per_pipeline
    return list(elements[start : start + per_pipeline])


def _glorot_uniform(shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """TF's `GlorotUniform()` initial value: uniform in +-sqrt(6 / (fan_in + fan_out))."""
    limit = np.sqrt(6.0 / sum(shape))
    return np.random.default_rng(seed).uniform(-limit, limit, shape).astype(np.float32)


# --- DistributionTestBase ----------------------------------------------------------------------


def _minimize_step(kernel: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    def loss(k: jax.Array) -> jax.Array:
        y = jnp.reshape(x @ k, ()) - 1.0
        return y * y

    g = get_replica_context().all_reduce(jaxstrategy.ReduceOp.SUM, jax.grad(loss)(kernel))
    return kernel, kernel - 0.2 * g


def check_minimize_loss_eager(strategy: jaxstrategy.Strategy) -> None:
    """strategy_test_lib.py: DistributionTestBase._test_minimize_loss_eager.

    One SGD step per `run` on a (1, 1) kernel, the gradient summed over the replicas (TF's
    `reduce_to(SUM)` then `update`): the error must go down over 10 steps.
    """
    with strategy.scope():
        kernel = strategy.put(_glorot_uniform((1, 1)))
    one = np.array([[1.0]], np.float32)
    with strategy.scope():
        for i in range(10):
            read, kernel = strategy.run(_minimize_step, args=(kernel, one))
            if i == 0:
                before = read
    error_before = abs(float(np.asarray(before)[0, 0]) - 1)
    error_after = abs(float(np.asarray(kernel)[0, 0]) - 1)
    assert error_after < error_before, (error_before, error_after)


def _replica_id() -> Any:
    return get_replica_context().replica_id_in_sync_group


def check_replica_id(strategy: jaxstrategy.Strategy) -> None:
    """strategy_test_lib.py: DistributionTestBase._test_replica_id.

    Each replica runs once and sees its own id, in [0, num_replicas_in_sync).
    """
    with strategy.scope():
        ids = strategy.run(_replica_id)
    seen = local(strategy, ids)
    assert all(0 <= i < strategy.num_replicas_in_sync for i in seen), seen
    assert seen == local_replica_ids(strategy), seen


def check_call_exceptions(strategy: jaxstrategy.Strategy) -> None:
    """strategy_test_lib.py: DistributionTestBase._test_call_and_merge_exceptions (the exception
    raised by the replica function itself propagates, with its own type)."""
    with strategy.scope(), pytest.raises(_TestException):
        strategy.run(_raise_exception_fn)


def check_merge_exceptions(strategy: jaxstrategy.Strategy) -> None:
    """strategy_test_lib.py: DistributionTestBase._test_call_and_merge_exceptions (the merge_call
    cases: TF propagates the exception raised in `merge_fn`, or in a replica function it runs).

    Departure: README MirroredStrategy table row `merge_call` (NotImplementedError, on
    OneDeviceStrategy too), so every merge_call case raises that before `merge_fn` runs.
    """
    for fn in (_merge_raises_fn, _merge_call_raises_fn, _merge_call_merge_raises_fn):
        with strategy.scope(), pytest.raises(NotImplementedError, match=r"merge_call\(\) is not supported"):
            strategy.run(fn)


def check_input_fn_iterable(
    strategy: jaxstrategy.Strategy,
    elements: Callable[[], Sequence[Any]],
    expected_values: Sequence[Sequence[Any]],
    *,
    expected_num_replicas_in_sync: int,
    expected_num_input_pipelines: int,
    expected_input_pipeline_id: int | None,
) -> None:
    """strategy_test_lib.py: DistributionTestBase._input_fn_to_test_input_context and
    _test_input_fn_iterable.

    `distribute_datasets_from_function` calls the input function with the expected
    `InputContext`; iterating gives `expected_values` (this process's replicas' elements per
    step), then StopIteration; a new `iter()` gives them all again.
    """
    worker_id_counter = [0]

    def input_fn(ctx: jaxstrategy.InputContext) -> Sequence[Any]:
        assert ctx is not None
        assert ctx.num_replicas_in_sync == expected_num_replicas_in_sync, ctx
        assert ctx.num_input_pipelines == expected_num_input_pipelines, ctx
        if expected_input_pipeline_id is not None:
            assert ctx.input_pipeline_id == expected_input_pipeline_id, ctx
        else:
            assert ctx.input_pipeline_id == worker_id_counter[0], ctx
            worker_id_counter[0] += 1
        return elements()

    iterable = strategy.distribute_datasets_from_function(input_fn)
    for _ in range(2):  # After re-initializing the iterator, it iterates again.
        iterator = iter(iterable)
        for expected_value in expected_values:
            assert local(strategy, next(iterator)) == list(expected_value)
        with pytest.raises(StopIteration):
            next(iterator)


# --- OneDeviceDistributionTestBase and TwoDeviceDistributionTestBase ---------------------------


def _four() -> jax.Array:
    return jnp.float32(4.0)


def _replica_id_plus_one() -> Any:
    return get_replica_context().replica_id_in_sync_group + 1


def _double_and_square(x: Any) -> dict[str, Any]:
    return {"a": x * 2, "b": x * x}


def _a_plus_2b_plus_2(b: Any, a: Any) -> Any:
    return a + 2 * b + 2


def check_run(strategy: jaxstrategy.Strategy, run_in_function: bool = False) -> None:
    """strategy_test_lib.py: OneDeviceDistributionTestBase._test_run and
    TwoDeviceDistributionTestBase._test_run, written for any number of replicas.

    On one replica `fn` returns the constant 4.0; on several, the replica id + 1 (TF's two
    versions). The outputs feed the next `run` by position and by keyword.
    """
    one_replica = strategy.num_replicas_in_sync == 1
    values = [4.0] if one_replica else [i + 1 for i in range(strategy.num_replicas_in_sync)]
    out1 = strategy.run(
        _maybe_run_in_function(_four if one_replica else _replica_id_plus_one, run_in_function)
    )
    assert local(strategy, out1) == mine(strategy, values)

    out2 = strategy.run(_maybe_run_in_function(_double_and_square, run_in_function), args=(out1,))
    assert local(strategy, out2) == mine(strategy, [{"a": v * 2, "b": v * v} for v in values])

    out3 = strategy.run(_maybe_run_in_function(_a_plus_2b_plus_2, run_in_function), kwargs=out2)
    # One replica: 8 + 2 * 16 + 2 = 42; two: [6, 14].
    assert local(strategy, out3) == mine(strategy, [2 * v + 2 * v * v + 2 for v in values])


def _per_replica_inputs(strategy: jaxstrategy.Strategy, inputs: Any) -> Any:
    """TF's `make_input_fn_iterator(lambda _: from_tensors/from_tensor_slices(inputs))`: replica
    i's element is the i-th slice of `inputs` (all of it with one replica)."""
    arrays = jax.tree.map(lambda x: np.asarray(x, np.float32), inputs, is_leaf=lambda x: isinstance(x, list))
    if strategy.num_replicas_in_sync == 1:
        elements = [arrays]
    else:
        elements = [jax.tree.map(lambda x, i=i: x[i], arrays) for i in range(strategy.num_replicas_in_sync)]
    dataset = strategy.distribute_datasets_from_function(lambda ctx: _this_pipelines_part(elements, ctx))
    return next(iter(dataset))


def check_collective_comms(
    strategy: jaxstrategy.Strategy,
    comm_fn: Callable[[Any], Any],
    inputs: Any,
    expected: tuple[float, list[float]],
    run_in_function: bool = False,
) -> None:
    """strategy_test_lib.py: (One|Two)DeviceDistributionTestBase._test_collective_comms: every
    replica gets the all-reduced pair."""
    element = _per_replica_inputs(strategy, inputs)
    outputs = strategy.run(_maybe_run_in_function(comm_fn, run_in_function), args=(element,))
    count = len(local_replica_ids(strategy))
    assert local(strategy, outputs[0]) == [expected[0]] * count
    assert local(strategy, outputs[1]) == [expected[1]] * count


def _gradient_step(c: jax.Array, *, op: str, mode: str) -> jax.Array:
    """d(comm(x) * c)/dx at x = 42, with `tf.gradients` (`mode='gradients'`: `jax.grad` of the
    summed output) or a `GradientTape` (`mode='tape'`: `jax.vjp` with ones)."""
    comm_fn = _all_sum if op == "sum" else _all_mean
    x = jnp.float32(42.0)
    if mode == "tape":
        y, pullback = jax.vjp(lambda x: comm_fn(x) * c, x)
        (grad,) = pullback(jnp.ones_like(y))
        return grad
    return jax.grad(lambda x: jnp.sum(comm_fn(x) * c))(x)


def check_collective_comms_gradients(
    strategy: jaxstrategy.Strategy,
    op: str,
    inputs: list[float],
    expected_grads: list[float],
    *,
    tape: bool,
    run_in_function: bool = False,
) -> None:
    """strategy_test_lib.py: (One|Two)DeviceDistributionTestBase._test_collective_comms_gradients
    (`tf.gradients`, here `jax.grad`) and _test_collective_comms_gradient_tape (here `jax.vjp`).

    Replica i computes d(comm_fn(x) * c_i)/dx at x = 42: the gradient of a collective carries
    every replica's upstream gradient (SUM: sum of the c_i; MEAN: their mean).
    """
    step = jax.jit(_gradient_step, static_argnames=("op", "mode")) if run_in_function else _gradient_step
    element = _per_replica_inputs(strategy, inputs)
    result = strategy.run(step, args=(element,), kwargs={"op": op, "mode": "tape" if tape else "gradients"})
    assert local(strategy, result) == mine(strategy, expected_grads)


def check_one_device_collectives(strategy: jaxstrategy.Strategy, name: str) -> None:
    """strategy_test_lib.py: OneDeviceDistributionTestBase._test_all_reduce_<name>."""
    if name == "sum":
        check_collective_comms(strategy, _all_sum, (4.0, [42.0, 43.0]), (4.0, [42.0, 43.0]))
    elif name == "mean":
        check_collective_comms(strategy, _all_mean, (2.0, [21.0, 22.0]), (2.0, [21.0, 22.0]))
    elif name.startswith("sum_gradient"):
        check_collective_comms_gradients(strategy, "sum", [4.0], [4.0], tape=name.endswith("tape"))
    else:
        check_collective_comms_gradients(strategy, "mean", [5.0], [5.0], tape=name.endswith("tape"))


def check_two_device_collectives(
    strategy: jaxstrategy.Strategy, name: str, run_in_function: bool = False
) -> None:
    """strategy_test_lib.py: TwoDeviceDistributionTestBase._test_all_reduce_<name>."""
    inputs = ([1.0, 3.0], [[39.0, 2.0], [3.0, 41.0]])
    if name == "sum":
        check_collective_comms(strategy, _all_sum, inputs, (4.0, [42.0, 43.0]), run_in_function)
    elif name == "mean":
        check_collective_comms(strategy, _all_mean, inputs, (2.0, [21.0, 21.5]), run_in_function)
    elif name.startswith("sum_gradient"):
        check_collective_comms_gradients(
            strategy,
            "sum",
            [1.0, 3.0],
            [4.0, 4.0],
            tape=name.endswith("tape"),
            run_in_function=run_in_function,
        )
    else:
        check_collective_comms_gradients(
            strategy,
            "mean",
            [1.0, 3.0],
            [2.0, 2.0],
            tape=name.endswith("tape"),
            run_in_function=run_in_function,
        )


COLLECTIVES = ["sum", "sum_gradients", "sum_gradient_tape", "mean", "mean_gradients", "mean_gradient_tape"]


def range_input_fn_iterable_expectations(n: int) -> tuple[Callable[[], list[np.ndarray]], list[list[int]]]:
    """TF's `Dataset.range(10)` input for _test_input_fn_iterable, grouped over `n` replicas
    (range(12) for four, which do not divide 10)."""
    size = 12 if n == 4 else 10
    return (lambda: [np.int32(i) for i in range(size)]), [list(range(i, i + n)) for i in range(0, size, n)]


# --- the checks, on the strategies the other modules do not cover ------------------------------

GENERAL = [
    c.default_strategy,
    c.mirrored_strategy_with_cpu_1_and_2,
    c.mirrored_strategy_with_four_cpus,
    c.multi_worker_mirrored_one_process,
]


@pytest.mark.parametrize("distribution", GENERAL, indirect=True, ids=str)
def test_minimize_loss_eager(distribution):
    """strategy_test_lib.py: DistributionTestBase._test_minimize_loss_eager"""
    check_minimize_loss_eager(distribution)


@pytest.mark.parametrize("distribution", GENERAL, indirect=True, ids=str)
def test_replica_id(distribution):
    """strategy_test_lib.py: DistributionTestBase._test_replica_id"""
    check_replica_id(distribution)


@pytest.mark.parametrize("distribution", GENERAL, indirect=True, ids=str)
def test_call_and_merge_exceptions_call(distribution):
    """strategy_test_lib.py: DistributionTestBase._test_call_and_merge_exceptions (call part)"""
    check_call_exceptions(distribution)


@pytest.mark.parametrize("distribution", GENERAL, indirect=True, ids=str)
def test_call_and_merge_exceptions_merge(distribution):
    """strategy_test_lib.py: DistributionTestBase._test_call_and_merge_exceptions (merge_call part).

    Departure: README MirroredStrategy table row `merge_call`."""
    check_merge_exceptions(distribution)


@pytest.mark.parametrize("distribution", GENERAL, indirect=True, ids=str)
def test_input_fn_iterable(distribution):
    """strategy_test_lib.py: DistributionTestBase._test_input_fn_iterable with
    _input_fn_to_test_input_context (TF's testReplicateDataset input, Dataset.range)."""
    n = distribution.num_replicas_in_sync
    elements, expected = range_input_fn_iterable_expectations(n)
    check_input_fn_iterable(
        distribution,
        elements,
        expected,
        expected_num_replicas_in_sync=n,
        expected_num_input_pipelines=1,
        expected_input_pipeline_id=None,  # Counted: called once, with id 0.
    )


@pytest.mark.parametrize("distribution", [c.default_strategy], indirect=True, ids=str)
@pytest.mark.parametrize("run_in_function", [False, True], ids=["eager", "tf_function"])
def test_one_device_run(distribution, run_in_function):
    """strategy_test_lib.py: OneDeviceDistributionTestBase._test_run"""
    check_run(distribution, run_in_function)


@pytest.mark.parametrize("distribution", [c.default_strategy], indirect=True, ids=str)
@pytest.mark.parametrize("name", COLLECTIVES)
def test_one_device_all_reduce(distribution, name):
    """strategy_test_lib.py: OneDeviceDistributionTestBase._test_all_reduce_{sum,mean}[_gradients,
    _gradient_tape] (the id names which)."""
    check_one_device_collectives(distribution, name)


@pytest.mark.parametrize("distribution", [c.mirrored_strategy_with_cpu_1_and_2], indirect=True, ids=str)
@pytest.mark.parametrize("run_in_function", [False, True], ids=["eager", "tf_function"])
def test_two_device_run(distribution, run_in_function):
    """strategy_test_lib.py: TwoDeviceDistributionTestBase._test_run (run_in_function: TF's
    tf.function-wrapped replica function, here jax.jit)"""
    check_run(distribution, run_in_function)


@pytest.mark.parametrize("distribution", [c.mirrored_strategy_with_cpu_1_and_2], indirect=True, ids=str)
@pytest.mark.parametrize("run_in_function", [False, True], ids=["eager", "tf_function"])
@pytest.mark.parametrize("name", COLLECTIVES)
def test_two_device_all_reduce(distribution, name, run_in_function):
    """strategy_test_lib.py: TwoDeviceDistributionTestBase._test_all_reduce_{sum,mean}[_gradients,
    _gradient_tape] (the id names which)"""
    check_two_device_collectives(distribution, name, run_in_function)


def test_two_process(two_process_case):
    """strategy_test_lib.py checks on multi_worker_mirrored_2x1_cpu, a real job of two processes;
    the case id names the TF check (see two_process_worker.py)."""
    two_process_case.check()
