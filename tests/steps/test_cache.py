"""How `run` caches what it compiles, on one device: keys, warnings, memory and bounds.

Static and donated arguments are behaviour every strategy shares: they are in conformance.py.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import re
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstrategy import RunOptions
from jaxstrategy._src.steps import cache


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_a_type_error_raised_by_fn_is_not_swallowed(strategy_cpu1):
    def step(x):
        raise TypeError("my own mistake")

    with pytest.raises(TypeError, match="my own mistake"):
        strategy_cpu1.run(step, args=(1,))


def test_outputs_are_committed_and_inputs_of_every_kind_compile_once(strategy_cpu1, cpu_devices):
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
        out = strategy_cpu1.run(step, args=(x,))
        assert out.committed and out.devices() == {strategy_cpu1.device}
    assert len(traces) == 1


def test_fresh_lambdas_get_one_warning_that_explains_the_fix(strategy_cpu1):
    with pytest.warns(UserWarning, match=r"compiled 3 different function objects") as record:
        for i in range(6):
            strategy_cpu1.run(lambda x: x + 1, args=(i,))
    assert len(record) == 1
    assert re.search(r"same code \(<lambda> at .*test_cache\.py:\d+\)", str(record[0].message))
    assert "Define the function once, outside the loop" in str(record[0].message)
    assert record[0].filename == __file__, "the warning points at the caller's line"


def test_fresh_partials_warn_too(strategy_cpu1):
    def scaled(x, scale):
        return x * scale

    with pytest.warns(UserWarning, match=r"same code \(scaled at"):
        for i in range(4):
            strategy_cpu1.run(functools.partial(scaled, scale=2.0), args=(i,))


def test_callable_objects_are_keyed_by_identity(strategy_cpu1):
    @dataclasses.dataclass
    class Scale:  # dataclass equality without a hash: unhashable, so keyed by id
        factor: float

        def __call__(self, x):
            return x * self.factor

    assert strategy_cpu1.run(Scale(2.0), args=(3.0,)).tolist() == 6.0
    assert strategy_cpu1.run(Scale(5.0), args=(3.0,)).tolist() == 15.0


def _adding(array):
    def closure(x):
        return x + array

    return closure


def test_dropped_functions_and_models_are_freed_with_their_compiled_steps(strategy_cpu1):
    class Model:
        def __init__(self):
            self.weights = jnp.ones((256, 256))

        def step(self, x):
            return x @ self.weights

    model = Model()
    strategy_cpu1.run(model.step, args=(jnp.ones(256),))
    weights = jnp.ones(8)
    closure = _adding(weights)
    strategy_cpu1.run(closure, args=(jnp.ones(8),))
    alive = [weakref.ref(model), weakref.ref(closure), weakref.ref(model.weights), weakref.ref(weights)]
    del model, closure, weights
    gc.collect()
    # The arrays too: a compiled step holds what its function closed over, so a step kept after
    # its function was dropped would keep them alive.
    assert [ref() for ref in alive] == [None, None, None, None]


def test_methods_of_several_objects_and_option_variants_do_not_warn(strategy_cpu1):
    class Model:
        def step(self, x):
            return x + 1

    models = [Model() for _ in range(4)]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")  # Record every warning, whatever the session's filters say.
        for model in models:
            strategy_cpu1.run(model.step, args=(jnp.ones(2),))
        for argnums in ((), 0):
            strategy_cpu1.run(
                _sgd, args=(jnp.ones(2), jnp.ones(2)), options=RunOptions(donate_argnums=argnums)
            )
        strategy_cpu1.run(_sgd, args=(jnp.ones(2), jnp.ones(2)), options=RunOptions(donate_argnames=()))
    assert [str(warning.message) for warning in record] == []


def test_tracing_errors_point_at_the_users_function(strategy_cpu1):
    def needs_a_concrete_flag(x, training):
        if training:
            return x
        return -x

    with pytest.raises(
        jax.errors.TracerBoolConversionError, match=r"needs_a_concrete_flag at .*test_cache.py"
    ):
        strategy_cpu1.run(needs_a_concrete_flag, args=(1.0, True))


def test_the_cache_is_bounded_and_drops_the_oldest_step(strategy_cpu1, monkeypatch):
    monkeypatch.setattr(cache, "_MAX_ENTRIES", 3)
    traced = []
    functions = []
    for i in range(5):  # Distinct code for each, so that no warning is raised.
        namespace = {"traced": traced}
        exec(f"def step_{i}(x):\n    traced.append({i})\n    return x + {i}", namespace)
        functions.append(namespace[f"step_{i}"])
    for fn in functions:
        strategy_cpu1.run(fn, args=(1,))
    assert traced == [0, 1, 2, 3, 4]
    strategy_cpu1.run(functions[4], args=(1,))  # Among the last three: still compiled.
    strategy_cpu1.run(functions[0], args=(1,))  # The oldest, dropped: compiled again.
    assert traced == [0, 1, 2, 3, 4, 0]
