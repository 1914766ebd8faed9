"""`run`'s hot path (strategies/run_path.py): what a compiled step's later calls check, and what
they cost in Python, on one device and on a mesh."""

from __future__ import annotations

import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxstrategy
from jaxstrategy import StrategyContextError
from jaxstrategy._src.strategies.strategy import Strategy

STRATEGIES = {
    "one device": lambda: jaxstrategy.OneDeviceStrategy("/cpu:1"),
    "mirrored": lambda: jaxstrategy.MirroredStrategy(jax.devices("cpu")[:2]),
    "sharded": lambda: jaxstrategy.ShardedStrategy(jax.devices("cpu")[:2], min_shard_bytes=8),
}


@pytest.fixture(params=list(STRATEGIES))
def strategy(request) -> Strategy:
    return STRATEGIES[request.param]()


def add_batch(state, batch):
    return jax.tree.map(lambda leaf: leaf + batch, state)


def double_every_leaf(*args):
    return jax.tree.map(lambda leaf: leaf * 2, args)


def local(strategy, tree):
    return jax.tree.map(np.asarray, strategy.experimental_local_results(tree)[0])


def python_calls_of(call, *args) -> list[str]:
    """The names of the Python functions `call(*args)` runs, in order (but XLA's garbage
    collection callbacks, which run when they will)."""
    names: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and not frame.f_code.co_name.startswith("_xla_gc"):
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        call(*args)
    finally:
        sys.setprofile(None)
    return names


class Int64Array(np.ndarray):
    """A subclass of numpy's array, as `np.memmap` and users' own are."""


# Each: a value 32 bits would change, one like it that they hold (what the step is compiled
# with: the same type as JAX sees it), and what the error says.
WIDE_LEAVES = {
    "int64 array": (
        np.array([1, 2**40 + 5], np.int64),
        np.array([1, 2], np.int64),
        r"is int64 with values from 1 to 1099511627781",
    ),
    "longlong scalar": (np.longlong(2**40 + 5), np.longlong(5), r"is int64 with the value 1099511627781"),
    "ndarray subclass": (
        np.array([1, 2**40 + 5], np.int64).view(Int64Array),
        np.array([1, 2], np.int64).view(Int64Array),
        r"is int64 with values from 1 to 1099511627781",
    ),
    "uint64 scalar": (np.uint64(2**33), np.uint64(3), r"is uint64 with the value 8589934592"),
    "float64 array": (np.full(2, 1e300), np.full(2, 0.5), r"is float64 with the finite value 1e\+300"),
    "python float": (1e300, 0.5, r"is the Python float 1e\+300, beyond float32's range"),
}


@pytest.mark.parametrize("wide", list(WIDE_LEAVES))
@pytest.mark.parametrize("where", ["top level", "nested", "last argument"])
def test_a_compiled_step_refuses_a_value_32_bits_would_change_at_any_position(strategy, where, wide):
    # jit would narrow each of these without retracing (2**40 + 5 becomes 5, 1e300 inf): the step
    # is compiled first with 32-bit values in the same structure, so the call below meets its
    # fast entry rather than a new trace.
    value, narrow, message = WIDE_LEAVES[wide]
    batch = strategy.put(np.ones(2, np.float32))

    def arguments(leaf):
        return {
            "top level": (leaf, batch),
            "nested": ({"a": batch, "b": [leaf]}, batch),
            "last argument": ({"a": batch}, leaf),
        }[where]

    for _ in range(2):
        strategy.run(double_every_leaf, args=arguments(narrow))
    with pytest.raises(OverflowError, match=message):
        strategy.run(double_every_leaf, args=arguments(value))


def test_infinities_and_nans_go_through_as_they_are(strategy):
    out = strategy.run(add_batch, args=({"a": np.float32(1)}, float("inf")))
    assert local(strategy, out)["a"].tolist() == np.inf
    out = strategy.run(add_batch, args=({"a": np.float32(1)}, float("nan")))
    assert np.isnan(local(strategy, out)["a"])


def test_an_nnx_variable_holding_a_64_bit_value_is_refused_by_name(strategy):
    class Counter(nnx.Module):
        def __init__(self):
            self.count = nnx.Variable(np.array([1], np.int32))

    def read(counter):
        return counter.count[...] + 0

    counter = strategy.put(Counter())
    for _ in range(2):
        strategy.run(read, args=(counter,))
    counter.count.set_value(np.array([2**40 + 5], np.int64))  # After `put`: a host value.
    with pytest.raises(OverflowError, match=r"args\[0\]\.count is int64 with the value 1099511627781"):
        strategy.run(read, args=(counter,))


def test_64_bit_host_values_that_fit_are_taken_by_the_checked_path_and_stay_right(strategy):
    state = strategy.put({"a": np.zeros(2, np.int32)})
    strategy.run(add_batch, args=(state, strategy.put(np.ones(2, np.int32))))
    out = strategy.run(add_batch, args=(state, np.array([3, 2**31 - 1], np.int64)))
    assert local(strategy, out)["a"].tolist() == [3, 2**31 - 1]
    out = strategy.run(add_batch, args=({"a": np.float64([0.5, 1.5])}, np.float32(1)))
    np.testing.assert_allclose(local(strategy, out)["a"], [1.5, 2.5])


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_hot_path_makes_as_many_python_calls_for_200_leaves_as_for_10(name):
    counts = {}
    for leaves in (10, 200):
        strategy = STRATEGIES[name]()  # Fresh, so that each makes the same calls in the same order.
        state = strategy.put({f"leaf_{i}": np.zeros(2, np.float32) for i in range(leaves)})
        batch = strategy.put(np.ones(2, np.float32))
        numpy_batch = np.ones(2, np.float32)
        for _ in range(2):  # The first numpy batch makes jit's C++ cache miss once.
            state = strategy.run(add_batch, args=(state, batch))
            state = strategy.run(add_batch, args=(state, numpy_batch))
        on_device = python_calls_of(strategy.run, add_batch, (state, batch))
        from_host = python_calls_of(strategy.run, add_batch, (state, numpy_batch))
        assert from_host.count("_is_wide") == 1  # The numpy batch's one dtype, not each leaf.
        counts[leaves] = len(on_device), len(from_host)
    # run, the checks of the arguments (flattened once, in C), and jit's own dispatch in C++; a
    # numpy leaf adds a look at each distinct dtype. On CPU meshes InFlightLimit adds its own,
    # and waits for every 8th step (here the numpy batch's: `jax.block_until_ready`).
    assert counts[10] == counts[200], counts
    assert counts[10][0] <= 12 and counts[10][1] <= 40, counts


def test_run_of_a_scalar_checks_no_leaf_in_python(strategy):
    x = strategy.put(np.float32(2))
    strategy.run(jnp.sin, args=(x,))
    calls = python_calls_of(lambda: strategy.run(jnp.sin, args=(x,)))
    assert (
        calls[:2] == ["<lambda>", "run"]
        and "has_wide_host_leaf" not in calls
        and "any_object_among" not in calls
    )


def test_a_compiled_step_is_not_called_inside_another_strategys_scope_or_inside_run(strategy):
    x = strategy.put(np.float32(2))
    strategy.run(jnp.sin, args=(x,))
    other = jaxstrategy.OneDeviceStrategy("/cpu:0")
    with (
        other.scope(),
        pytest.raises(
            StrategyContextError, match=r"Mixing different Strategy objects: .* inside the scope of"
        ),
    ):
        strategy.run(jnp.sin, args=(x,))

    def calls_run(y):
        return strategy.run(jnp.sin, args=(y,))

    with pytest.raises(
        StrategyContextError,
        match=r"requires the cross-replica context, but it was called inside Strategy.run",
    ):
        strategy.run(calls_run, args=(x,))
    with strategy.scope():  # Its own scope is fine.
        np.testing.assert_allclose(local(strategy, strategy.run(jnp.sin, args=(x,))), np.sin(2.0), rtol=1e-6)


def test_an_nnx_object_given_to_a_step_compiled_for_its_state_goes_straight_to_the_checked_path(strategy):
    def add_one(layer):
        layer.bias[...] = layer.bias[...] + 1
        return layer.bias[...]

    layer = strategy.put(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
    state = strategy.put(nnx.state(layer))
    for _ in range(2):
        strategy.run(add_one, args=(state,))  # Compiled for the state: a pytree of arrays.
    for _ in range(2):
        strategy.run(add_one, args=(layer,))
    # Updated in place, and without first trying (and failing) to trace the step for the state
    # with the object's leaves, which would cost a trace at every call.
    calls = python_calls_of(lambda: strategy.run(add_one, args=(layer,)))
    assert "cache_miss" not in calls, calls
    assert local(strategy, layer.bias[...]).tolist() == [3.0]


def test_run_patched_on_the_class_after_a_first_call_is_what_later_calls_reach():
    strategy = jaxstrategy.OneDeviceStrategy()
    strategy.run(jnp.sin, args=(1.0,))  # A spy in a test suite often comes after the first step.
    with mock.patch.object(jaxstrategy.OneDeviceStrategy, "run", autospec=True, return_value="spied") as spy:
        assert strategy.run(jnp.sin, args=(1.0,)) == "spied"
    assert spy.call_count == 1


def test_a_subclass_that_overrides_run_is_called_at_every_step():
    class Counting(jaxstrategy.OneDeviceStrategy):
        calls = 0

        def run(self, fn, args=(), kwargs=None, options=None):
            Counting.calls += 1
            return super().run(fn, args, kwargs, options)

    strategy = Counting()
    for _ in range(3):
        strategy.run(jnp.sin, args=(1.0,))
    assert Counting.calls == 3


def test_python_control_on_a_traced_value_gets_the_static_arguments_hint(strategy):
    def branches(x, training):
        return x * 2 if training else x

    with pytest.raises(jax.errors.TracerBoolConversionError) as error:
        strategy.run(branches, args=(1.0, True))
    assert any("RunOptions(static_argnums=...)" in note for note in error.value.__notes__)


class _RecordingSteps:
    """A stand-in for `StepCache`: one fast entry, and a checked path, each saying it was taken."""

    layout_depends_on_arguments = False

    def __init__(self, fn):
        from jaxstrategy._src.steps.cache import function_key

        self.fast_entries = {function_key(fn): lambda *args: "fast entry"}

    def __call__(self, fn, args, kwargs, options):
        return "checked path"


_ADMISSION_ARGUMENTS = {
    "jax array": lambda: (jnp.ones(2),),
    "python int": lambda: (3,),
    "numpy float32": lambda: (np.ones(2, np.float32),),
    "numpy int64 that fits": lambda: (np.int64(5),),
    "numpy int64 beyond 32 bits": lambda: (np.int64(2**40),),
    "python float beyond float32": lambda: (1e300,),
    "dict of arrays": lambda: ({"w": jnp.ones(2)},),
    "nnx module": lambda: (nnx.Linear(1, 1, rngs=nnx.Rngs(0)),),
    "string": lambda: ("train",),
}
_ADMISSION_CONTEXTS = ("outside every scope", "its own scope", "another strategy's scope", "inside run")


@pytest.mark.parametrize("context", _ADMISSION_CONTEXTS)
@pytest.mark.parametrize("arguments", list(_ADMISSION_ARGUMENTS))
def test_the_inline_admission_check_answers_as_fast_entry_takes(arguments, context):
    # `RunPath.run` copies `fast_entry_takes` inline, for speed: both must admit the same calls.
    import contextlib

    from jaxstrategy._src.strategies.run_path import RunPath, fast_entry_takes
    from jaxstrategy._src.values import contexts

    strategy = jaxstrategy.OneDeviceStrategy("/cpu:0")
    fn = lambda *args: args  # noqa: E731
    path = RunPath(strategy, _RecordingSteps(fn), before_checked_path=lambda caller: None, caller="run()")
    args = _ADMISSION_ARGUMENTS[arguments]()
    entered = {
        "outside every scope": contextlib.nullcontext(),
        "its own scope": contexts.entered(strategy),
        "another strategy's scope": contexts.entered(jaxstrategy.OneDeviceStrategy("/cpu:1")),
        "inside run": contexts.entered(strategy, object()),
    }[context]
    with entered:
        expected = fast_entry_takes(strategy, args)
        try:
            taken = path.run(fn, args)
        except Exception:  # The checked path refuses some of these calls itself.
            taken = "checked path"
    assert (taken == "fast entry") is expected
