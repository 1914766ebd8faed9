"""Behaviour every strategy must share, checked against docs/semantics.md.

A strategy's test module subclasses `StrategyConformance` and gives it a `strategy_under_test`
fixture (not `strategy`: that is the pytest plugin's fixture of every strategy this process can
build). The expectations are written in terms of `num_replicas_in_sync` and of this process's
replicas, so the same tests hold on one device, on many, and in every process of a multi-worker
job (where test_multi_worker.py runs them). Rows that only make sense on one device live in
test_one_device.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import os
import re
import threading
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from training_reference import (
    OPTIMIZERS,
    flax_docs_objects,
    flax_docs_train_step,
    host_value,
    nnx_jit_training,
    reference_training,
    strategy_training,
    training_batches,
)

import jaxstrategy
from jaxstrategy import ReduceOp, RunOptions
from jaxstrategy._src.cluster.local_workers import describe_results, run_local_workers
from jaxstrategy.testing import assert_tree_on_strategy

_REPO_ROOT = Path(__file__).resolve().parents[1]
# Where the workers running the conformance suite share a directory (checkpoints must be in one).
_SHARED_TMP_ENV = "JAXSTRATEGY_TEST_SHARED_TMP"


@pytest.fixture(name="tmp_path")
def shared_tmp_path(request, tmp_path_factory):
    """`tmp_path`, but one directory for every process of a job running the suite (see
    `assert_conformance_passes_in_two_processes`). A module imports it to use it."""
    shared = os.environ.get(_SHARED_TMP_ENV)
    if shared is None:
        return tmp_path_factory.mktemp(re.sub(r"\W", "_", request.node.name)[:30])
    path = Path(shared) / re.sub(r"\W", "_", request.node.nodeid)
    path.mkdir(parents=True, exist_ok=True)
    return path


def assert_conformance_passes_in_two_processes(test_file: str, tmp_path: Path, timeout: float) -> None:
    """Run `test_file`'s `TestConformance` in each process of a job of two processes of two CPU
    devices (its `strategy_under_test` fixture makes the job's strategy), sharing `tmp_path`."""
    env = {**os.environ, _SHARED_TMP_ENV: str(tmp_path)}
    command = ["-m", "pytest", f"{Path(test_file).resolve().relative_to(_REPO_ROOT)}::TestConformance", "-q"]
    results = run_local_workers(command, 2, devices_per_worker=2, timeout=timeout, env=env, cwd=_REPO_ROOT)
    assert all(result.returncode == 0 for result in results), describe_results(results)
    summaries = [re.search(r"(\d+) passed", result.stdout) for result in results]
    assert all(summaries) and summaries[0][1] == summaries[1][1], describe_results(results)
    assert int(summaries[0][1]) > 50


def _double(x):
    return x * 2


def _x_of(tree):
    return tree["x"]


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float


def first_local(strategy, value):
    """This process's first replica's part of `value` (the whole of a replicated value)."""
    return strategy.experimental_local_results(value)[0]


def devices_per_replica(strategy) -> int:
    """How many devices each replica has: one, but on `ShardedStrategy`."""
    return len(strategy.devices) // strategy.num_replicas_in_sync


def replica_devices(strategy, i: int) -> set:
    """This process's devices of replica `i` (consecutive in `strategy.devices`): all of them,
    but where a replica of a sharded strategy spans processes."""
    s = devices_per_replica(strategy)
    return {d for d in strategy.devices[i * s : (i + 1) * s] if d.process_index == jax.process_index()}


def local_replica_ids(strategy) -> list[int]:
    """The ids of the replicas this process holds devices of: all, with one process (a replica
    of a sharded strategy may span processes, each holding some of its devices)."""
    s = devices_per_replica(strategy)
    return [
        i
        for i in range(strategy.num_replicas_in_sync)
        if any(d.process_index == jax.process_index() for d in strategy.devices[i * s : (i + 1) * s])
    ]


def has_replica_values(strategy) -> bool:
    """Whether values that may differ between replicas come back as `PerReplica`s (on every
    strategy but `OneDeviceStrategy`, even with one replica)."""
    return not isinstance(strategy, jaxstrategy.OneDeviceStrategy)


def holds_only_some_replicas(strategy) -> bool:
    """Whether other processes hold replicas this one does not (a job of several processes, but
    one whose replicas each span all of them)."""
    return len(local_replica_ids(strategy)) < strategy.num_replicas_in_sync


class StrategyConformance:
    """Tests run against the `strategy_under_test` fixture of the subclass."""

    # --- run ---------------------------------------------------------------------------------

    def test_spec_loop_prints_90_and_traces_once(self, strategy_under_test, capsys):
        traces = []

        def step_fn(x):
            traces.append(x)
            return x * 2

        result = 0
        for i in range(10):
            result += strategy_under_test.run(step_fn, args=(i,))
        print(result)
        assert capsys.readouterr().out == "90\n"
        assert len(traces) == 1, "step_fn was traced more than once"

    def test_run_outputs_are_committed_arrays_on_the_strategy(self, strategy_under_test):
        out = strategy_under_test.run(lambda x, y: {"sum": x + y, "scaled": x * 0.5}, args=(np.float32(3), 4))
        assert_tree_on_strategy(out, strategy_under_test)

    def test_run_passes_kwargs_and_accepts_a_list_of_args(self, strategy_under_test):
        out = strategy_under_test.run(lambda x, *, scale: x * scale, args=[3], kwargs={"scale": 2})
        assert strategy_under_test.experimental_local_results(out)[0].tolist() == 6

    def test_run_rejects_args_that_are_not_a_list_or_tuple(self, strategy_under_test):
        with pytest.raises(
            ValueError, match=r"positional args must be a list or tuple, got int.*args=\(x,\)"
        ):
            strategy_under_test.run(_double, args=3)

    def test_run_rejects_kwargs_that_are_not_a_dict(self, strategy_under_test):
        with pytest.raises(TypeError, match=r"kwargs must be a dict; got list"):
            strategy_under_test.run(_double, args=(1,), kwargs=[("x", 1)])

    def test_run_rejects_options_of_the_wrong_type(self, strategy_under_test):
        with pytest.raises(TypeError, match=r"options must be a jaxstrategy.RunOptions; got \{\}"):
            strategy_under_test.run(_double, args=(1,), options={})

    def test_run_rejects_a_non_callable_before_tracing(self, strategy_under_test):
        with pytest.raises(TypeError, match=r"run\(\): fn must be callable; got 42"):
            strategy_under_test.run(42)

    def test_run_inside_run_is_an_error(self, strategy_under_test):
        def outer(x):
            return strategy_under_test.run(_double, args=(x,))

        with pytest.raises(jaxstrategy.StrategyContextError, match=r"requires the cross-replica context"):
            strategy_under_test.run(outer, args=(1,))

    def test_a_compiled_step_still_checks_where_it_is_called(self, strategy_under_test):
        # run's fast path calls a compiled step with few checks: it must still refuse the replica
        # context and another strategy's scope.
        strategy_under_test.run(_double, args=(jnp.ones(2),))  # Compiled: the fast path from now.
        strategy_under_test.run(_double, args=(jnp.ones(2),))
        others = (jaxstrategy.OneDeviceStrategy(device) for device in jax.local_devices())
        other = next(o for o in others if o != strategy_under_test)
        with (
            other.scope(),
            pytest.raises(jaxstrategy.StrategyContextError, match=r"Mixing different Strategy"),
        ):
            strategy_under_test.run(_double, args=(jnp.ones(2),))

        def outer(x):
            return strategy_under_test.run(_double, args=(x,))

        with pytest.raises(jaxstrategy.StrategyContextError, match=r"requires the cross-replica context"):
            strategy_under_test.run(outer, args=(jnp.ones(2),))

    def test_a_step_compiled_for_arrays_still_updates_a_module_nested_in_the_arguments(
        self, strategy_under_test
    ):
        layer = strategy_under_test.put(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))

        def step(inputs):
            held = inputs["held"]
            if isinstance(held, nnx.Module):
                held.bias[...] = held.bias[...] + 1
                return held.bias[...]
            return held * 2

        strategy_under_test.run(step, args=({"held": jnp.ones(1)},))  # Compiled for an array.
        strategy_under_test.run(step, args=({"held": layer},))
        strategy_under_test.run(step, args=({"held": layer},))
        assert layer.bias[...].tolist() == [2.0]

    def test_run_compiles_once_for_python_ints(self, strategy_under_test):
        chex.clear_trace_counter()  # chex counts per code object, across parametrized runs.

        @chex.assert_max_traces(n=1)
        def step(x):
            return x + 1

        for i in range(20):
            strategy_under_test.run(step, args=(i,))

    def test_run_of_a_bound_method_passed_each_step_traces_once(self, strategy_under_test):
        class Model:
            traces = 0

            def step(self, x):
                Model.traces += 1
                return x * 3

        model = Model()
        for i in range(5):
            strategy_under_test.run(model.step, args=(i,))
        assert Model.traces == 1

    # --- static arguments and donation -------------------------------------------------------

    def test_non_array_arguments_are_static_and_select_code(self, strategy_under_test):
        traces = []

        def step(x, mode, config, name="a"):
            traces.append((mode, config, name))
            y = x * config.scale
            return y if mode is Mode.TRAIN else -y

        def run(*args, **kwargs):
            return first_local(
                strategy_under_test, strategy_under_test.run(step, args=args, kwargs=kwargs)
            ).tolist()

        assert run(2.0, Mode.TRAIN, Config(3.0)) == 6.0
        assert run(5.0, Mode.TRAIN, Config(3.0)) == 15.0
        assert run(2.0, Mode.EVAL, Config(3.0), name="b") == -6.0
        assert len(traces) == 2, "a new static value compiles once; a new array value never does"

    def test_a_plain_enum_alone_is_static_and_an_int_enum_is_traced_as_jax_jit_does(
        self, strategy_under_test
    ):

        class Level(enum.IntEnum):
            LOW = 1
            HIGH = 2

        def scale(x, mode):
            return x * 2 if mode is Mode.EVAL else x

        out = strategy_under_test.run(scale, args=(jnp.ones(2), Mode.EVAL))
        assert first_local(strategy_under_test, out).tolist() == [2.0, 2.0]
        out = strategy_under_test.run(scale, args=(jnp.ones(2), Mode.TRAIN))
        assert first_local(strategy_under_test, out).tolist() == [1.0, 1.0]
        traced = []
        strategy_under_test.run(lambda x, level: traced.append(level) or x * level, args=(1.0, Level.HIGH))
        assert isinstance(traced[0], jax.core.Tracer)

    def test_equal_static_numbers_of_different_types_compile_separately(self, strategy_under_test):
        def full(value):
            return jnp.full((2,), value)

        dtypes = [
            first_local(strategy_under_test, strategy_under_test.init(full, v)).dtype for v in (1, 1.0, True)
        ]
        assert dtypes == [jnp.int32, jnp.float32, jnp.bool_]

    def test_the_first_call_with_static_leaves_then_array_only_calls(self, strategy_under_test):

        def step(x, label=None):
            return x + 1

        assert (
            first_local(
                strategy_under_test, strategy_under_test.run(step, args=(1,), kwargs={"label": "x"})
            ).tolist()
            == 2
        )
        assert first_local(strategy_under_test, strategy_under_test.run(step, args=(1,))).tolist() == 2

    def test_unhashable_non_array_arguments_are_named_by_path(self, strategy_under_test):
        class Unhashable:
            __hash__ = None  # type: ignore[assignment]

        with pytest.raises(TypeError) as info:
            strategy_under_test.run(
                lambda x, cfg, extra: x, args=(1, {"a": Unhashable()}), kwargs={"extra": Unhashable()}
            )
        message = str(info.value)
        assert message.startswith(
            f"{type(strategy_under_test).__name__}.run(): compile-time constants (arguments that are not arrays, and"
        )
        assert "\n  args[1]['a'] is a Unhashable\n  kwargs['extra'] is a Unhashable\n" in message
        assert "close over them in the function" in message

    def test_static_argnames_make_a_flag_a_compile_time_constant(self, strategy_under_test):
        traces = []

        def step(x, *, training):
            traces.append(training)
            return x * 0.5 if training else x

        options = RunOptions(static_argnames="training")
        for _ in range(3):
            for training, expected in ((True, 2.0), (False, 4.0)):
                out = strategy_under_test.run(
                    step, args=(4.0,), kwargs={"training": training}, options=options
                )
                assert first_local(strategy_under_test, out).tolist() == expected
        assert traces == [True, False], "one compile per value of the flag"

    def test_static_argnums_with_a_pytree_of_settings(self, strategy_under_test):
        def step(x, settings):
            return x * settings["scale"] if settings["enabled"] else x

        options = RunOptions(static_argnums=1)
        out = strategy_under_test.run(
            step, args=(jnp.ones(2), {"enabled": True, "scale": 3}), options=options
        )
        assert first_local(strategy_under_test, out).tolist() == [3.0, 3.0]

    def test_a_static_array_is_named_as_unhashable(self, strategy_under_test):
        with pytest.raises(
            TypeError,
            match=r"compile-time constants .* must be hashable, but these are not:\n  args\[1\] is a ArrayImpl",
        ):
            strategy_under_test.run(
                lambda x, y: x, args=(1.0, jnp.ones(2)), options=RunOptions(static_argnums=1)
            )

    def test_a_static_argument_that_is_not_passed_is_an_error(self, strategy_under_test):
        # A position past the end, or a name passed positionally, would silently be traced.
        with pytest.raises(
            ValueError,
            match=r"names arguments that this call does not pass \(static_argnums position 5\); it passed 2 positional",
        ):
            strategy_under_test.run(_sgd, args=(1.0, 1.0), options=RunOptions(static_argnums=5))
        with pytest.raises(
            ValueError, match=r"\(static_argnames name 'x'\).*pass a named argument as a keyword"
        ):
            strategy_under_test.run(_sgd, args=(1.0, 1.0), options=RunOptions(static_argnames="x"))

    def test_donated_arguments_are_consumed(self, strategy_under_test):
        params = strategy_under_test.put({"w": np.ones(4, np.float32)})
        grads = strategy_under_test.put({"w": np.ones(4, np.float32)})
        new = strategy_under_test.run(_sgd, args=(params, grads), options=RunOptions(donate_argnums=0))
        np.testing.assert_allclose(first_local(strategy_under_test, new["w"]), 0.9)
        assert params["w"].is_deleted()
        assert not grads["w"].is_deleted()

    def test_donation_by_name(self, strategy_under_test):
        state = strategy_under_test.put(np.ones(2, np.float32))
        new = strategy_under_test.run(
            lambda step, state: state + step,
            args=(1,),
            kwargs={"state": state},
            options=RunOptions(donate_argnames="state"),
        )
        assert first_local(strategy_under_test, new).tolist() == [2.0, 2.0] and state.is_deleted()

    def test_donating_a_buffer_passed_twice_is_a_clear_error(self, strategy_under_test):
        params = strategy_under_test.put({"w": np.ones(4, np.float32)})
        with pytest.raises(
            ValueError,
            match=r"the same array is passed as args\[0\]\['w'\] and as args\[1\]\['w'\], and args\[0\]\['w'\] is donated",
        ):
            strategy_under_test.run(_sgd, args=(params, params), options=RunOptions(donate_argnums=0))
        assert not params["w"].is_deleted(), "nothing was donated"
        with pytest.raises(
            ValueError, match=r"args\[0\]\['w'\] and as args\[1\]\['w'\].*Pass a copy \(jnp.copy\(x\)\)"
        ):
            strategy_under_test.run(_sgd, args=(params, params), options=RunOptions(donate_argnums=(0, 1)))

    def test_a_compiled_donating_step_still_refuses_an_array_passed_twice(self, strategy_under_test):
        params = strategy_under_test.put({"w": np.ones(4, np.float32)})
        grads = strategy_under_test.put({"w": np.ones(4, np.float32)})
        donate = RunOptions(donate_argnums=0)
        params = strategy_under_test.run(_sgd, args=(params, grads), options=donate)  # Compiled.
        params = strategy_under_test.run(_sgd, args=(params, grads), options=donate)  # Its fast path.
        np.testing.assert_allclose(first_local(strategy_under_test, params["w"]), 0.8)
        # On the fast path too: XLA was seen to hang here on CPU devices rather than refuse.
        with pytest.raises(
            ValueError, match=r"the same array is passed as args\[0\]\['w'\] and as args\[1\]\['w'\]"
        ):
            strategy_under_test.run(_sgd, args=(params, params), options=donate)
        assert not params["w"].is_deleted(), "nothing was donated"
        with pytest.raises(ValueError, match=r"passed as args\[0\]\['v'\] and as args\[0\]\['w'\]"):
            twice = {"w": params["w"], "v": params["w"]}
            strategy_under_test.run(lambda p, g: p, args=(twice, grads), options=donate)

    def test_donating_an_argument_that_is_not_passed_is_an_error(self, strategy_under_test):
        with pytest.raises(
            ValueError,
            match=r"names arguments that this call does not pass \(donate_argnums position 2, donate_argnames name 'state'\)",
        ):
            strategy_under_test.run(
                _sgd, args=(1.0, 1.0), options=RunOptions(donate_argnums=2, donate_argnames="state")
            )

    def test_donated_python_numbers_are_not_mistaken_for_a_shared_buffer(self, strategy_under_test):
        def add(tree, y):
            return {"a": tree["a"] + y, "b": tree["b"] + y}  # Outputs like the donated inputs: reusable.

        out = strategy_under_test.run(add, args=({"a": 1, "b": 1}, 1), options=RunOptions(donate_argnums=0))
        out = first_local(strategy_under_test, out)
        assert (out["a"].tolist(), out["b"].tolist()) == (2, 2)

    def test_donation_with_static_leaves_and_no_recompile(self, strategy_under_test):
        traces = []

        def step(state, mode):
            traces.append(mode)
            return state + 1

        state = strategy_under_test.put(np.zeros(3, np.float32))
        for _ in range(3):
            state = strategy_under_test.run(step, args=(state, "train"), options=RunOptions(donate_argnums=0))
        assert first_local(strategy_under_test, state).tolist() == [3.0, 3.0, 3.0] and len(traces) == 1

    # --- replica context ---------------------------------------------------------------------

    def test_replica_context_inside_run(self, strategy_under_test):
        seen = {}

        def step(x):
            context = jaxstrategy.get_replica_context()
            seen["context"] = context
            seen["in_cross_replica"] = jaxstrategy.in_cross_replica_context()
            seen["strategy"] = jaxstrategy.get_strategy()
            return context.replica_id_in_sync_group + x * 0

        ids = strategy_under_test.run(step, args=(0,))
        context = seen["context"]
        assert context.strategy is strategy_under_test
        assert context.num_replicas_in_sync == strategy_under_test.num_replicas_in_sync
        assert seen["in_cross_replica"] is False
        assert seen["strategy"] is strategy_under_test
        local = [int(v) for v in strategy_under_test.experimental_local_results(ids)]
        assert local == local_replica_ids(strategy_under_test)
        assert strategy_under_test.experimental_local_results(ids)[0].dtype == jnp.int32

    def test_all_reduce_sum_and_mean(self, strategy_under_test):
        n = strategy_under_test.num_replicas_in_sync

        def step(x):
            context = jaxstrategy.get_replica_context()
            return context.all_reduce("sum", x), context.all_reduce(ReduceOp.MEAN, x)

        total, mean = strategy_under_test.run(step, args=(jnp.int32(2),))
        assert strategy_under_test.experimental_local_results(total)[0].tolist() == 2 * n
        assert strategy_under_test.experimental_local_results(mean)[0].tolist() == 2.0
        assert strategy_under_test.experimental_local_results(mean)[0].dtype == jnp.float32

    def test_all_reduce_rejects_an_unknown_op(self, strategy_under_test):
        def step(x):
            return jaxstrategy.get_replica_context().all_reduce("max", x)

        with pytest.raises(ValueError, match=r"'max' is not a valid ReduceOp; expected ReduceOp.SUM"):
            strategy_under_test.run(step, args=(1.0,))

    def test_all_gather_rejects_a_scalar(self, strategy_under_test):
        def step(x):
            return jaxstrategy.get_replica_context().all_gather(x, axis=0)

        with pytest.raises(ValueError, match=r"is a scalar \(rank 0\), so it has no axis 0"):
            strategy_under_test.run(step, args=(1.0,))

    def test_all_gather_concatenates_replicas(self, strategy_under_test):
        def step(x):
            return jaxstrategy.get_replica_context().all_gather(x, axis=0)

        gathered = strategy_under_test.run(step, args=(jnp.ones((2, 3)),))
        assert strategy_under_test.experimental_local_results(gathered)[0].shape == (
            2 * strategy_under_test.num_replicas_in_sync,
            3,
        )

    # --- reduce ------------------------------------------------------------------------------

    def test_reduce_requires_axis(self, strategy_under_test):
        with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'axis'"):
            strategy_under_test.reduce(ReduceOp.SUM, jnp.arange(3))

    @pytest.mark.parametrize("op", ["sum", "SUM", "Sum", ReduceOp.SUM], ids=str)
    def test_reduce_sum_along_axis(self, strategy_under_test, op):
        values = strategy_under_test.experimental_distribute_values_from_function(lambda _: jnp.arange(10))
        result = strategy_under_test.reduce(op, values, axis=0)
        assert result.tolist() == 45 * strategy_under_test.num_replicas_in_sync
        assert_tree_on_strategy(result, strategy_under_test)

    @pytest.mark.parametrize("op", ["mean", "Mean", ReduceOp.MEAN], ids=str)
    def test_reduce_mean_along_axis_is_a_float_of_the_global_mean(self, strategy_under_test, op):
        values = strategy_under_test.experimental_distribute_values_from_function(lambda _: jnp.arange(10))
        result = strategy_under_test.reduce(op, values, axis=0)
        assert result.tolist() == 4.5
        assert result.dtype == jnp.float32

    @pytest.mark.parametrize("op", ["max", "bogus"])
    def test_reduce_rejects_unknown_op_names(self, strategy_under_test, op):
        with pytest.raises(ValueError, match=rf"'{op}' is not a valid ReduceOp; expected ReduceOp.SUM"):
            strategy_under_test.reduce(op, jnp.arange(3), axis=None)

    @pytest.mark.parametrize("op", [None, 1])
    def test_reduce_rejects_ops_of_the_wrong_type(self, strategy_under_test, op):
        with pytest.raises(TypeError, match=rf"reduce_op must be ReduceOp.SUM.*got {op!r} of type"):
            strategy_under_test.reduce(op, jnp.arange(3), axis=0)

    def test_reduce_of_a_scalar_along_an_axis_names_the_rank(self, strategy_under_test):
        with pytest.raises(ValueError, match=r"is a scalar \(rank 0\), so it has no axis 0"):
            strategy_under_test.reduce("sum", jnp.float32(1), axis=0)

    def test_reduce_out_of_range_axis_names_rank_and_axis(self, strategy_under_test):
        with pytest.raises(ValueError, match=r"axis 2 is out of range for the value, which has rank 2"):
            strategy_under_test.reduce("mean", jnp.ones((2, 3)), axis=2)

    def test_reduce_names_every_bad_leaf(self, strategy_under_test):
        tree = {"ok": jnp.ones((2, 2)), "bad": jnp.float32(0), "worse": jnp.ones(3)}
        with pytest.raises(
            ValueError, match=r"value\['bad'\] is a scalar.*\n.*value\['worse'\], which has rank 1"
        ) as info:
            strategy_under_test.reduce("sum", tree, axis=(0, 1))
        assert "value['ok']" not in str(info.value)

    def test_reduce_inside_run_is_an_error(self, strategy_under_test):
        def step(x):
            return strategy_under_test.reduce("sum", x, axis=None)

        with pytest.raises(jaxstrategy.StrategyContextError, match=r"all_reduce\(\) inside run"):
            strategy_under_test.run(step, args=(1.0,))

    # --- gather ------------------------------------------------------------------------------

    def test_gather_rejects_a_scalar(self, strategy_under_test):
        with pytest.raises(ValueError, match=r"gather\(\): the value is a scalar \(rank 0\)"):
            strategy_under_test.gather(jnp.float32(1), axis=0)

    @pytest.mark.parametrize("axis", [3, -4])
    def test_gather_rejects_an_axis_out_of_range(self, strategy_under_test, axis):
        value = jnp.arange(6).reshape(1, 2, 3)
        with pytest.raises(
            ValueError, match=rf"axis {axis} is out of range .* rank 3; expected an axis in \[-3, 3\)"
        ):
            strategy_under_test.gather(value, axis=axis)

    def test_gather_inside_run_is_an_error(self, strategy_under_test):
        def step(x):
            return strategy_under_test.gather(x, axis=0)

        with pytest.raises(jaxstrategy.StrategyContextError, match=r"all_gather\(\) inside run instead"):
            strategy_under_test.run(step, args=(jnp.ones(2),))

    # --- values and local results ------------------------------------------------------------

    def test_values_from_function_are_placed_per_replica(self, strategy_under_test):
        contexts = []

        def value_fn(context):
            contexts.append(context)
            return np.float32(context.replica_id_in_sync_group)

        values = strategy_under_test.experimental_distribute_values_from_function(value_fn)
        local = strategy_under_test.experimental_local_results(values)
        ids = local_replica_ids(strategy_under_test)
        assert [c.replica_id_in_sync_group for c in contexts] == ids
        assert {c.num_replicas_in_sync for c in contexts} == {strategy_under_test.num_replicas_in_sync}
        assert [float(v) for v in local] == [float(i) for i in ids]
        for value, i in zip(local, ids, strict=True):
            assert value.devices() == replica_devices(strategy_under_test, i) and value.committed

    def test_values_from_function_rejects_a_non_callable(self, strategy_under_test):
        with pytest.raises(TypeError, match=r"value_fn must be callable with a ValueContext; got 1"):
            strategy_under_test.experimental_distribute_values_from_function(1)

    def test_local_results_of_run_has_one_value_per_local_replica(self, strategy_under_test):
        out = strategy_under_test.run(_double, args=(1,))
        assert len(strategy_under_test.experimental_local_results(out)) == len(
            local_replica_ids(strategy_under_test)
        )

    # --- scope and context -------------------------------------------------------------------

    def test_scope_makes_the_strategy_current_and_its_device_the_default(self, strategy_under_test):
        assert not jaxstrategy.has_strategy()
        with strategy_under_test.scope() as current:
            assert current is strategy_under_test
            assert jaxstrategy.get_strategy() is strategy_under_test
            assert jaxstrategy.has_strategy() and jaxstrategy.in_cross_replica_context()
            assert jaxstrategy.get_replica_context() is None
            created = jnp.zeros(3)
        # The first device of this process's first replica that this process holds.
        first = local_replica_ids(strategy_under_test)[0]
        s = devices_per_replica(strategy_under_test)
        here = [
            d
            for d in strategy_under_test.devices[first * s : (first + 1) * s]
            if d.process_index == jax.process_index()
        ]
        assert created.devices() == {here[0]}
        assert not jaxstrategy.has_strategy()

    def test_one_scope_object_can_be_entered_again_and_nested(self, strategy_under_test):
        # TensorFlow allows `with scope: ...` twice on one `strategy.scope()` object.
        scope = strategy_under_test.scope()
        for _ in range(2):
            with scope as current:
                assert current is strategy_under_test and jaxstrategy.get_strategy() is strategy_under_test
                with scope:
                    assert jaxstrategy.in_cross_replica_context()
            assert not jaxstrategy.has_strategy()

    def test_scope_of_the_same_strategy_nests(self, strategy_under_test):
        with strategy_under_test.scope(), strategy_under_test.scope():
            assert jaxstrategy.get_strategy() is strategy_under_test

    def test_scope_inside_run_is_an_error(self, strategy_under_test):
        def step(x):
            with strategy_under_test.scope():
                return x

        with pytest.raises(jaxstrategy.StrategyContextError, match=r"Enter the scope outside the function"):
            strategy_under_test.run(step, args=(1,))

    def test_a_new_thread_starts_outside_the_scope(self, strategy_under_test):
        seen = []
        with strategy_under_test.scope():
            thread = threading.Thread(target=lambda: seen.append(jaxstrategy.has_strategy()))
            thread.start()
            thread.join(timeout=10)
        assert seen == [False]

    def test_scope_follows_asyncio_tasks(self, strategy_under_test):
        async def current():
            await asyncio.sleep(0)
            return jaxstrategy.get_strategy()

        async def main():
            with strategy_under_test.scope():
                inside = await asyncio.create_task(current())
            outside = await asyncio.create_task(current())
            return inside, outside

        inside, outside = asyncio.run(main())
        assert inside is strategy_under_test and outside is not strategy_under_test

    # --- distributed datasets ----------------------------------------------------------------

    def test_distributed_dataset_is_re_iterable_and_on_the_strategy(self, strategy_under_test):
        n = strategy_under_test.num_replicas_in_sync
        # Two examples per device of each replica.
        size = 2 * devices_per_replica(strategy_under_test)
        batches = [np.arange(i, i + size * n) for i in range(0, 5 * size * n, size * n)]
        dataset = strategy_under_test.experimental_distribute_dataset(batches)
        ids = local_replica_ids(strategy_under_test)
        # Each process holds its replicas' parts of every batch (all of it, with one process).
        expected = [b.reshape(n, size)[ids].reshape(-1).tolist() for b in batches]
        for _ in range(2):
            seen = []
            for batch in dataset:
                for i, local in zip(ids, strategy_under_test.experimental_local_results(batch), strict=True):
                    assert local.committed and local.devices() == replica_devices(strategy_under_test, i)
                seen.append(
                    np.concatenate(
                        [np.asarray(v) for v in strategy_under_test.experimental_local_results(batch)]
                    )
                )
            assert [s.tolist() for s in seen] == expected

    def test_get_next_past_the_end(self, strategy_under_test):
        iterator = iter(
            strategy_under_test.experimental_distribute_dataset([np.zeros(len(strategy_under_test.devices))])
        )
        iterator.get_next()
        with pytest.raises(jaxstrategy.OutOfRangeError, match="End of sequence"):
            iterator.get_next()
        with pytest.raises(StopIteration):
            next(iterator)

    def test_get_next_as_optional(self, strategy_under_test):
        iterator = iter(
            strategy_under_test.experimental_distribute_dataset([np.ones(len(strategy_under_test.devices))])
        )
        optional = iterator.get_next_as_optional()
        assert optional.has_value()
        assert strategy_under_test.experimental_local_results(optional.get_value())[0].tolist()[0] == 1.0
        empty = iterator.get_next_as_optional()
        assert not empty.has_value()
        with pytest.raises(ValueError, match=r"get_value\(\): this optional has no value"):
            empty.get_value()

    def test_fetch_to_device_false_yields_host_arrays(self, strategy_under_test):
        options = jaxstrategy.InputOptions(experimental_fetch_to_device=False)
        batches = [np.ones(2 * len(strategy_under_test.devices))]
        if holds_only_some_replicas(strategy_under_test):
            with pytest.raises(
                NotImplementedError,
                match=r"experimental_fetch_to_device=False\) is not supported across processes",
            ):
                strategy_under_test.experimental_distribute_dataset(batches, options)
            return
        dataset = strategy_under_test.experimental_distribute_dataset(batches, options)
        (batch,) = list(dataset)
        assert all(isinstance(leaf, np.ndarray) for leaf in jax.tree.leaves(batch))

    def test_per_replica_mode_is_rejected_for_experimental_distribute_dataset(self, strategy_under_test):
        options = jaxstrategy.InputOptions(experimental_replication_mode="PER_REPLICA")
        with pytest.raises(
            NotImplementedError, match=r"PER_REPLICA is only supported in `distribute_datasets_from_function`"
        ):
            strategy_under_test.experimental_distribute_dataset(
                [np.ones(2 * strategy_under_test.num_replicas_in_sync)], options
            )

    def test_distribute_datasets_from_function_calls_it_once(self, strategy_under_test):
        contexts = []

        local_replicas = len(local_replica_ids(strategy_under_test))

        def dataset_fn(context):
            contexts.append(context)
            # One element per local replica per step: two steps.
            per_replica = context.get_per_replica_batch_size(4 * strategy_under_test.num_replicas_in_sync)
            return [np.ones(per_replica)] * (2 * local_replicas)

        dataset = strategy_under_test.distribute_datasets_from_function(dataset_fn)
        assert len(list(dataset)) == 2 and len(list(dataset)) == 2
        pipeline = jaxstrategy.InputContext(
            jax.process_count() if holds_only_some_replicas(strategy_under_test) else 1,
            jax.process_index() if holds_only_some_replicas(strategy_under_test) else 0,
            strategy_under_test.num_replicas_in_sync,
        )
        assert contexts == [pipeline]

    def test_the_deprecated_name_of_distribute_datasets_from_function_warns_and_works(
        self, strategy_under_test
    ):
        n = strategy_under_test.num_replicas_in_sync
        size = 2 * devices_per_replica(strategy_under_test)
        with pytest.warns(
            DeprecationWarning,
            match=r"experimental_distribute_datasets_from_function\(\) is deprecated, as in TensorFlow: call distribute_datasets_from_function\(\)",
        ):
            dataset = strategy_under_test.experimental_distribute_datasets_from_function(
                lambda context: [np.ones(size)] * n
            )
        assert [
            np.shape(part) for part in strategy_under_test.experimental_local_results(next(iter(dataset)))
        ][0] == (size,)

    def test_next_inside_run_is_an_error(self, strategy_under_test):
        n = strategy_under_test.num_replicas_in_sync
        iterator = iter(strategy_under_test.experimental_distribute_dataset([np.ones(2 * n)] * 3))

        def step(x):
            return next(iterator)

        with pytest.raises(jaxstrategy.StrategyContextError, match=r"args=\(next\(iterator\),\)"):
            strategy_under_test.run(step, args=(1,))
        with pytest.raises(ValueError, match=r"args=\(next\(iterator\),\)"):  # As TensorFlow.
            strategy_under_test.run(step, args=(1,))

    def test_a_distributed_iterator_or_dataset_as_an_argument_is_an_error(self, strategy_under_test):
        dataset = strategy_under_test.experimental_distribute_dataset(
            [np.ones(2 * strategy_under_test.num_replicas_in_sync)]
        )
        for given in (dataset, iter(dataset)):
            with pytest.raises(
                ValueError, match=r"an argument is a distributed dataset or iterator; run takes its elements"
            ):
                strategy_under_test.run(_double, args=(given,))
            with pytest.raises(ValueError, match=r"Pass strategy.run\(step_fn, args=\(next\(iterator\),\)\)"):
                strategy_under_test.run(_double, kwargs={"x": given})

    # --- variables ---------------------------------------------------------------------------

    def test_put_commits_every_leaf(self, strategy_under_test):
        params = strategy_under_test.put({"w": np.ones((2, 3), np.float32), "b": 0.0, "step": np.int32(0)})
        assert_tree_on_strategy(params, strategy_under_test)

    def test_values_that_32_bit_types_would_change_are_an_error(self, strategy_under_test):
        # With jax_enable_x64 off, JAX would wrap 2**40 + 5 to 5 and turn 1e300 into inf.
        with pytest.raises(
            OverflowError,
            match=r"put\(\): these values do not fit the 32-bit types.*\n  tree\['big'\] is int64 with the value 1099511627781, outside int32's -2147483648 to 2147483647\n.*jax_enable_x64",
        ):
            strategy_under_test.put({"big": np.array([2**40 + 5]), "fine": np.arange(3)})
        with pytest.raises(OverflowError, match=r"tree\['n'\] is the Python int 1099511627776"):
            strategy_under_test.put({"n": 2**40})
        with pytest.raises(OverflowError, match=r"tree is float64 with the finite value 1e\+300"):
            strategy_under_test.put(np.array([1e300, np.inf]))
        with pytest.raises(
            OverflowError,
            match=r"(?s)experimental_distribute_values_from_function\(\): .*is uint64 with the value 8589934592",
        ):
            strategy_under_test.experimental_distribute_values_from_function(
                lambda context: np.array([2**33], np.uint64)
            )
        assert strategy_under_test.experimental_local_results(strategy_under_test.put(np.array([2**31 - 1])))[
            0
        ].tolist() == [2**31 - 1]

    def test_run_arguments_that_32_bit_types_would_change_are_an_error(self, strategy_under_test):
        # docs/semantics.md, the row of `run` given a value 32 bits would change. A global batch
        # of 4 fits every strategy's replicas. The first call compiles the step, so the later ones
        # take run's hot path.
        fits = np.array([1, 2, 3, 2**31 - 1])
        assert strategy_under_test.experimental_local_results(strategy_under_test.run(_double, args=(fits,)))
        with pytest.raises(
            OverflowError,
            match=r"run\(\): these values do not fit the 32-bit types.*\n  args\[0\] is int64 with values from 1 to 1099511627781, outside int32's",
        ):
            strategy_under_test.run(_double, args=(np.array([1, 2, 3, 2**40 + 5]),))
        with pytest.raises(OverflowError, match=r"args\[0\]\['x'\] is float64 with the finite value 1e\+300"):
            strategy_under_test.run(_x_of, args=({"x": np.full(4, 1e300)},))
        with pytest.raises(OverflowError, match=r"kwargs\['x'\] is uint64 with the value 8589934592"):
            strategy_under_test.run(_double, kwargs={"x": np.uint64(2**33)})
        strategy_under_test.run(_double, args=(0.5,))
        with pytest.raises(
            OverflowError, match=r"args\[0\] is the Python float 1e\+300, beyond float32's range"
        ):
            strategy_under_test.run(_double, args=(1e300,))

    def test_dataset_values_that_32_bit_types_would_change_are_an_error(self, strategy_under_test):
        dataset = strategy_under_test.experimental_distribute_dataset([np.arange(8), np.full(8, 2**40 + 5)])
        iterator = iter(dataset)
        next(iterator)  # The first batch fits.
        with pytest.raises(
            OverflowError,
            match=r"the distributed dataset: .*\n  element is int64 with the value 1099511627781, outside int32's",
        ):
            next(iterator)

    def test_init_creates_outputs_on_the_strategy(self, strategy_under_test):
        params = strategy_under_test.init(
            lambda key: {"w": jax.random.normal(key, (4, 4))}, jax.random.key(0)
        )
        assert_tree_on_strategy(params, strategy_under_test)

    def test_checkpoint_round_trip_onto_the_strategy(self, strategy_under_test, tmp_path):
        from jaxstrategy import checkpoint

        saved = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "key": jax.random.key(3)}
        checkpoint.save(tmp_path, saved)
        restored = checkpoint.restore(tmp_path, strategy=strategy_under_test, target=saved)
        assert restored["w"].tolist() == saved["w"].tolist()
        assert (jax.random.key_data(restored["key"]) == jax.random.key_data(saved["key"])).all()
        assert_tree_on_strategy(restored, strategy_under_test)

    def test_extended_and_basic_attributes(self, strategy_under_test):
        assert strategy_under_test.num_replicas_in_sync * devices_per_replica(strategy_under_test) == len(
            strategy_under_test.devices
        )
        extended = strategy_under_test.extended
        # This process's devices: of each of its replicas, those it holds.
        ids = local_replica_ids(strategy_under_test)
        local_devices = sum(len(replica_devices(strategy_under_test, i)) for i in ids)
        assert len(extended.worker_devices) == local_devices
        assert extended.parameter_devices == extended.worker_devices
        assert all(name.startswith("/job:") for name in extended.worker_devices)

    # --- gradients (docs/semantics.md, "Gradients inside `run`") -------------------------------

    def test_tensorflow_gradient_rows(self, strategy_under_test):
        # The table of docs/semantics.md, measured with TensorFlow 2.21 on 2 replicas: replica r
        # holds x_r = r + 1 and every replica w = 3. The rows hold for n replicas as written here
        # (n = 2 gives TF's [1, 2], 1.5, 3, [2, 4], [4, 8], [4, 8], 2.85).
        n = strategy_under_test.num_replicas_in_sync
        x = np.arange(1, n + 1, dtype=np.float32)
        mine = x[local_replica_ids(strategy_under_test)]
        w = strategy_under_test.put(np.float32(3.0))
        xs = strategy_under_test.experimental_distribute_values_from_function(
            lambda context: jnp.float32(context.replica_id_in_sync_group + 1)
        )

        def local_grad(x, w):
            return jax.grad(lambda w: w * x)(w)

        def all_reduce(op, value):
            return jaxstrategy.get_replica_context().all_reduce(op, value)

        def all_gather(value):
            return jaxstrategy.get_replica_context().all_gather(value, axis=0)

        rows = {
            "local grad of w*x_r": (local_grad, mine),
            "all_reduce MEAN of local grads": (lambda x, w: all_reduce("mean", local_grad(x, w)), x.mean()),
            "all_reduce SUM of local grads": (lambda x, w: all_reduce("sum", local_grad(x, w)), x.sum()),
            "grad of all_reduce(SUM, w*x_r)": (
                lambda x, w: jax.grad(lambda w: all_reduce("sum", w * x))(w),
                n * mine,
            ),
            "grad wrt x_r of sum(all_gather(x)^2)": (
                lambda x, w: jax.grad(lambda x: jnp.sum(all_gather(x.reshape(1)) ** 2))(x),
                2 * n * mine,
            ),
            "grad wrt x_r of all_reduce(SUM, x_r^2)": (
                lambda x, w: jax.grad(lambda x: all_reduce("sum", x**2))(x),
                2 * n * mine,
            ),
            "w - 0.1 * mean grad": (
                lambda x, w: w - 0.1 * all_reduce("mean", local_grad(x, w)),
                3 - 0.1 * x.mean(),
            ),
            # Forward mode differentiates the global sum (docs/semantics.md, after the table).
            "jacfwd of all_reduce(SUM, w*x_r)": (
                lambda x, w: jax.jacfwd(lambda w: all_reduce("sum", w * x))(w),
                x.sum(),
            ),
        }
        for name, (fn, expected) in rows.items():
            out = strategy_under_test.run(fn, args=(xs, w))
            got = [float(v) for v in strategy_under_test.experimental_local_results(out)]
            np.testing.assert_allclose(got, np.broadcast_to(expected, len(mine)), rtol=1e-6, err_msg=name)
            # Replicated exactly where every replica holds the same value, as TensorFlow's
            # MirroredVariable results; a replica's own gradient is a PerReplica.
            same_everywhere = np.ndim(expected) == 0
            assert isinstance(out, jaxstrategy.PerReplica) == (
                has_replica_values(strategy_under_test) and not same_everywhere
            ), name

    def test_new_parameters_from_unreduced_gradients_are_per_replica(self, strategy_under_test):
        w = strategy_under_test.put(np.float32(3.0))
        xs = strategy_under_test.experimental_distribute_values_from_function(
            lambda context: jnp.float32(context.replica_id_in_sync_group + 1)
        )
        new_w = strategy_under_test.run(lambda x, w: w - 0.1 * jax.grad(lambda w: w * x)(w), args=(xs, w))
        expected = [3 - 0.1 * (i + 1) for i in local_replica_ids(strategy_under_test)]
        np.testing.assert_allclose(
            [float(v) for v in strategy_under_test.experimental_local_results(new_w)], expected
        )
        assert isinstance(new_w, jaxstrategy.PerReplica) == has_replica_values(strategy_under_test)

    @pytest.mark.parametrize("idiom", ["mean_loss", "compute_average_loss"])
    @pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
    def test_training_matches_a_plain_jit_loop(self, strategy_under_test, optimizer, idiom):
        batches = training_batches([16, 16, 16, 16])
        expected_losses, expected_params = reference_training(optimizer, (16, 16, 16, 16))
        losses, params = strategy_training(strategy_under_test, OPTIMIZERS[optimizer](), batches, idiom)
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-6)

    def test_a_padded_last_batch_trains_on_its_real_examples(self, strategy_under_test):
        # 13 examples do not split over 2 or 4 replicas: padded, masked, and divided by 13.
        batches = training_batches([16, 16, 13])
        expected_losses, expected_params = reference_training("sgd", (16, 16, 13))
        options = jaxstrategy.InputOptions(partial_batch="pad")
        losses, params = strategy_training(strategy_under_test, optax.sgd(0.1), batches, "masked", options)
        np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
        chex.assert_trees_all_close(params, expected_params, rtol=1e-5, atol=1e-6)

    # --- Flax NNX objects --------------------------------------------------------------------

    def test_the_flax_docs_loop_runs_unchanged_and_matches_nnx_jit(self, strategy_under_test):
        batches = training_batches([16, 16, 16, 16])
        expected = nnx_jit_training((16, 16, 16, 16))
        model, optimizer = flax_docs_objects()
        assert strategy_under_test.put(model) is model and strategy_under_test.put(optimizer) is optimizer
        losses = []
        with jax.numpy_dtype_promotion("standard"):
            for batch in strategy_under_test.experimental_distribute_dataset(batches):
                losses.append(
                    float(strategy_under_test.run(flax_docs_train_step, args=(model, optimizer, batch)))
                )
        np.testing.assert_allclose(losses, expected.losses, rtol=1e-5)
        first_replica = strategy_under_test.experimental_local_results(nnx.state(model, nnx.Param))[0]
        chex.assert_trees_all_close(
            jax.tree.map(host_value, nnx.to_pure_dict(first_replica)), expected.params, rtol=1e-5, atol=1e-6
        )
        assert int(optimizer.step[...]) == len(batches)
        # The key counter advanced once per step, as under nnx.jit.
        initial_count = int(flax_docs_objects()[0].rngs.default.count[...])
        assert expected.rng_count == initial_count + len(batches)
        assert int(model.rngs.default.count[...]) == initial_count + len(batches)
        assert_tree_on_strategy(nnx.state((model, optimizer)), strategy_under_test)
