"""How `run` compiles and calls: caching, static arguments, donation and their errors."""

from __future__ import annotations

import dataclasses
import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstrategy import OneDeviceStrategy, RunOptions
from jaxstrategy._src import step_cache


@pytest.fixture
def strategy():
    return OneDeviceStrategy("/cpu:1")


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float


def test_non_array_arguments_are_static_and_select_code(strategy):
    traces = []

    def step(x, mode, config, name="a"):
        traces.append((mode, config, name))
        y = x * config.scale
        return y if mode is Mode.TRAIN else -y

    assert strategy.run(step, args=(2.0, Mode.TRAIN, Config(3.0))).tolist() == 6.0
    assert strategy.run(step, args=(5.0, Mode.TRAIN, Config(3.0))).tolist() == 15.0
    assert strategy.run(step, args=(2.0, Mode.EVAL, Config(3.0)), kwargs={"name": "b"}).tolist() == -6.0
    assert len(traces) == 2, "a new static value compiles once; a new array value never does"


def test_a_plain_enum_alone_is_static_and_an_int_enum_is_traced_as_jax_jit_does(strategy):
    class Level(enum.IntEnum):
        LOW = 1
        HIGH = 2

    def scale(x, mode):
        return x * 2 if mode is Mode.EVAL else x

    assert strategy.run(scale, args=(jnp.ones(2), Mode.EVAL)).tolist() == [2.0, 2.0]
    assert strategy.run(scale, args=(jnp.ones(2), Mode.TRAIN)).tolist() == [1.0, 1.0]
    traced = []
    strategy.run(lambda x, level: traced.append(level) or x * level, args=(1.0, Level.HIGH))
    assert isinstance(traced[0], jax.core.Tracer)


def test_equal_static_numbers_of_different_types_compile_separately(strategy):
    def full(value):
        return jnp.full((2,), value)

    dtypes = [strategy.init(full, value).dtype for value in (1, 1.0, True)]
    assert dtypes == [jnp.int32, jnp.float32, jnp.bool_]


def test_the_first_call_with_static_leaves_then_array_only_calls(strategy):
    def step(x, label=None):
        return x + 1

    assert strategy.run(step, args=(1,), kwargs={"label": "x"}).tolist() == 2
    assert strategy.run(step, args=(1,)).tolist() == 2


def test_unhashable_non_array_arguments_are_named_by_path(strategy):
    class Unhashable:
        __hash__ = None  # type: ignore[assignment]

    with pytest.raises(TypeError) as info:
        strategy.run(lambda x, cfg, extra: x, args=(1, {"a": Unhashable()}), kwargs={"extra": Unhashable()})
    message = str(info.value)
    assert message.startswith(
        "OneDeviceStrategy.run(): compile-time constants (arguments that are not arrays, and"
    )
    assert "\n  args[1]['a'] is a Unhashable\n  kwargs['extra'] is a Unhashable\n" in message
    assert "close over them in the function" in message


def test_a_type_error_raised_by_fn_is_not_swallowed(strategy):
    def step(x):
        raise TypeError("my own mistake")

    with pytest.raises(TypeError, match="my own mistake"):
        strategy.run(step, args=(1,))


def test_outputs_are_committed_and_inputs_of_every_kind_compile_once(strategy, cpu_devices):
    traces = []

    def step(x):
        traces.append(1)
        return x + 1

    inputs = [
        np.ones(3, np.float32),
        jnp.ones(3),
        jax.device_put(jnp.ones(3), cpu_devices[0]),
        jax.device_put(jnp.ones(3), cpu_devices[1]),
    ]
    for x in inputs:
        out = strategy.run(step, args=(x,))
        assert out.committed and out.devices() == {strategy.device}
    assert len(traces) == 1


def test_fresh_lambdas_get_one_warning_that_explains_the_fix(strategy):
    with pytest.warns(
        UserWarning,
        match=r"compiled 3 different function objects made from the same code \(<lambda> at .*test_step_cache.py",
    ) as record:
        for i in range(6):
            strategy.run(lambda x: x + 1, args=(i,))
    assert len(record) == 1
    assert "Define the function once, outside the loop" in str(record[0].message)
    assert record[0].filename == __file__, "the warning points at the caller's line"


def test_fresh_partials_warn_too(strategy):
    def scaled(x, scale):
        return x * scale

    with pytest.warns(UserWarning, match=r"same code \(scaled at"):
        for i in range(4):
            strategy.run(functools.partial(scaled, scale=2.0), args=(i,))


def test_callable_objects_are_keyed_by_identity(strategy):
    @dataclasses.dataclass
    class Scale:  # dataclass equality without a hash: unhashable, so keyed by id
        factor: float

        def __call__(self, x):
            return x * self.factor

    assert strategy.run(Scale(2.0), args=(3.0,)).tolist() == 6.0
    assert strategy.run(Scale(5.0), args=(3.0,)).tolist() == 15.0


def test_dropped_functions_and_models_are_freed_with_their_entries(strategy):
    import gc
    import weakref

    class Model:
        def __init__(self):
            self.weights = jnp.ones((256, 256))

        def step(self, x):
            return x @ self.weights

    model = Model()
    strategy.run(model.step, args=(jnp.ones(256),))
    weights = jnp.ones(8)

    def closure(x):
        return x + weights

    strategy.run(closure, args=(jnp.ones(8),))
    alive = [weakref.ref(model), weakref.ref(closure)]
    entries_before = len(strategy._run_steps._entries)
    del model, closure
    gc.collect()
    assert [ref() for ref in alive] == [None, None]
    assert len(strategy._run_steps._entries) == entries_before - 2


def test_methods_of_several_objects_and_option_variants_do_not_warn(strategy):
    class Model:
        def step(self, x):
            return x + 1

    models = [Model() for _ in range(4)]
    for model in models:
        strategy.run(model.step, args=(jnp.ones(2),))
    for argnums in ((), 0):
        strategy.run(_sgd, args=(jnp.ones(2), jnp.ones(2)), options=RunOptions(donate_argnums=argnums))
    strategy.run(_sgd, args=(jnp.ones(2), jnp.ones(2)), options=RunOptions(donate_argnames=()))


def test_tracing_errors_point_at_the_users_function(strategy):
    def needs_a_concrete_flag(x, training):
        if training:
            return x
        return -x

    with pytest.raises(
        jax.errors.TracerBoolConversionError, match=r"needs_a_concrete_flag at .*test_step_cache.py"
    ):
        strategy.run(needs_a_concrete_flag, args=(1.0, True))


def test_the_cache_is_bounded(strategy, monkeypatch):
    monkeypatch.setattr(step_cache, "_MAX_ENTRIES", 3)
    functions = [eval(f"lambda x: x + {i}") for i in range(5)]  # distinct code: no warning
    for fn in functions:
        strategy.run(fn, args=(1,))
    assert len(strategy._run_steps._entries) == 3


# --- static arguments --------------------------------------------------------------------------


def test_static_argnames_make_a_flag_a_compile_time_constant(strategy):
    traces = []

    def step(x, *, training):
        traces.append(training)
        return x * 0.5 if training else x

    options = RunOptions(static_argnames="training")
    for _ in range(3):
        assert strategy.run(step, args=(4.0,), kwargs={"training": True}, options=options).tolist() == 2.0
        assert strategy.run(step, args=(4.0,), kwargs={"training": False}, options=options).tolist() == 4.0
    assert traces == [True, False], "one compile per value of the flag"


def test_static_argnums_with_a_pytree_of_settings(strategy):
    def step(x, settings):
        return x * settings["scale"] if settings["enabled"] else x

    options = RunOptions(static_argnums=1)
    out = strategy.run(step, args=(jnp.ones(2), {"enabled": True, "scale": 3}), options=options)
    assert out.tolist() == [3.0, 3.0]


def test_a_static_array_is_named_as_unhashable(strategy):
    with pytest.raises(
        TypeError,
        match=r"compile-time constants .* must be hashable, but these are not:\n  args\[1\] is a ArrayImpl",
    ):
        strategy.run(lambda x, y: x, args=(1.0, jnp.ones(2)), options=RunOptions(static_argnums=1))


# --- donation ----------------------------------------------------------------------------------


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_donated_arguments_are_consumed(strategy):
    params = strategy.put({"w": np.ones(4, np.float32)})
    grads = strategy.put({"w": np.ones(4, np.float32)})
    new = strategy.run(_sgd, args=(params, grads), options=RunOptions(donate_argnums=0))
    np.testing.assert_allclose(new["w"], 0.9)
    assert params["w"].is_deleted()
    assert not grads["w"].is_deleted()


def test_donation_by_name(strategy):
    state = strategy.put(np.ones(2, np.float32))
    new = strategy.run(
        lambda step, state: state + step,
        args=(1,),
        kwargs={"state": state},
        options=RunOptions(donate_argnames="state"),
    )
    assert new.tolist() == [2.0, 2.0] and state.is_deleted()


def test_donating_a_buffer_passed_twice_is_a_clear_error(strategy):
    params = strategy.put({"w": np.ones(4, np.float32)})
    with pytest.raises(
        ValueError,
        match=r"the same array is passed as args\[0\]\['w'\] and as args\[1\]\['w'\], and args\[0\]\['w'\] is donated",
    ):
        strategy.run(_sgd, args=(params, params), options=RunOptions(donate_argnums=0))
    assert not params["w"].is_deleted(), "nothing was donated"
    with pytest.raises(
        ValueError, match=r"args\[0\]\['w'\] and as args\[1\]\['w'\].*Pass a copy \(jnp.copy\(x\)\)"
    ):
        strategy.run(_sgd, args=(params, params), options=RunOptions(donate_argnums=(0, 1)))


def test_donating_an_argument_that_is_not_passed_is_an_error(strategy):
    with pytest.raises(
        ValueError,
        match=r"names arguments that this call does not pass \(donate_argnums position 2, donate_argnames name 'state'\)",
    ):
        strategy.run(_sgd, args=(1.0, 1.0), options=RunOptions(donate_argnums=2, donate_argnames="state"))


def test_a_static_argument_that_is_not_passed_is_an_error(strategy):
    # A position past the end, or a name passed positionally, would silently be traced.
    with pytest.raises(
        ValueError,
        match=r"names arguments that this call does not pass \(static_argnums position 5\); it passed 2 positional",
    ):
        strategy.run(_sgd, args=(1.0, 1.0), options=RunOptions(static_argnums=5))
    with pytest.raises(ValueError, match=r"\(static_argnames name 'x'\).*pass a named argument as a keyword"):
        strategy.run(_sgd, args=(1.0, 1.0), options=RunOptions(static_argnames="x"))


def test_donated_python_numbers_are_not_mistaken_for_a_shared_buffer(strategy):
    def add(tree, y):
        return {"a": tree["a"] + y, "b": tree["b"] + y}  # Outputs like the donated inputs: reusable.

    out = strategy.run(add, args=({"a": 1, "b": 1}, 1), options=RunOptions(donate_argnums=0))
    assert (out["a"].tolist(), out["b"].tolist()) == (2, 2)


def test_donation_with_static_leaves_and_no_recompile(strategy):
    traces = []

    def step(state, mode):
        traces.append(mode)
        return state + 1

    state = strategy.put(np.zeros(3, np.float32))
    for _ in range(3):
        state = strategy.run(step, args=(state, "train"), options=RunOptions(donate_argnums=0))
    assert state.tolist() == [3.0, 3.0, 3.0] and len(traces) == 1
