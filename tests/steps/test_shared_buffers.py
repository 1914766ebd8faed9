"""Donating an array whose device buffer another argument also uses: the library's error, never a crash.

`put` gives every variable buffers of its own, and `run` compares buffers, not only Python
identity, where a call donates. XLA refuses such a call on one device (`INVALID_ARGUMENT`) and
crashes the process on several (a segfault, on JAX 0.10.2), so the cases that crashed run in a
subprocess of their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import RunOptions
from jaxstrategy._src.values.variables import device_buffers

DONATE_FIRST = RunOptions(donate_argnums=(0,))
# The two arguments, what they share, and which one is donated.
_SHARE = r"args\[0\] and as args\[1\] share a device buffer .*, and args\[0\] is donated"


def _add(a, b):
    return a + b


@pytest.fixture(params=["one-device", "mirrored-4"])
def strategy(request, cpu_devices):
    if request.param == "one-device":
        return jaxstrategy.OneDeviceStrategy()
    return jaxstrategy.MirroredStrategy(cpu_devices[:4])


def test_put_gives_every_variable_buffers_of_its_own(strategy):
    x = jnp.arange(8.0)
    numbers = np.arange(8.0, dtype=np.float32)
    first, second = strategy.put(x), strategy.put(x)
    tree = strategy.put({"a": x, "b": x, "c": numbers, "d": numbers})
    placed = [first, second, *tree.values()]
    buffers = [device_buffers(array) for array in placed]
    for i, mine in enumerate(buffers):
        assert len(mine) == len(strategy.devices)
        assert mine.isdisjoint(device_buffers(x)), "shares the array it was put from"
        for theirs in buffers[i + 1 :]:
            assert mine.isdisjoint(theirs), "two variables share a buffer"
    for array in placed:
        assert array.committed and array.sharding.is_equivalent_to(strategy.sharding, 1)
        np.testing.assert_array_equal(np.asarray(array), np.arange(8.0))


def test_arrays_with_no_elements_own_no_buffer_to_share(strategy):
    # Their addresses may all be null on an accelerator: never taken for one shared buffer.
    empty = strategy.put({"a": jnp.zeros((0, 3)), "b": jnp.zeros((0, 3))})
    assert device_buffers(empty["a"]) == device_buffers(empty["b"]) == set()
    strategy.run(lambda a, b: (a, b), args=(empty["a"], empty["b"]), options=DONATE_FIRST)


def test_a_put_variable_donated_leaves_the_array_it_came_from(strategy):
    x = jnp.arange(8.0)
    a, b = strategy.put(x), strategy.put(x)
    for _ in range(2):  # The second call takes the fast path where there is one.
        a = strategy.run(_add, args=(a, b), options=DONATE_FIRST)
    np.testing.assert_array_equal(np.asarray(a), 3 * np.arange(8.0))
    np.testing.assert_array_equal(np.asarray(x), np.arange(8.0))


def test_two_device_puts_of_one_array_donated_on_one_device_are_the_librarys_error():
    strategy = jaxstrategy.OneDeviceStrategy()
    ones = strategy.put(jnp.ones(8))
    strategy.run(_add, args=(strategy.put(jnp.ones(8)), ones), options=DONATE_FIRST)  # A fast entry.
    x = jnp.arange(8.0)
    a, b = jax.device_put(x, strategy.sharding), jax.device_put(x, strategy.sharding)
    assert device_buffers(a) == device_buffers(b) and a is not b
    for _ in range(2):  # Through the fast entry, whose call XLA refuses, and on the slow path.
        with pytest.raises(ValueError, match=_SHARE):
            strategy.run(_add, args=(a, b), options=DONATE_FIRST)
        assert not a.is_deleted() and not b.is_deleted()
    np.testing.assert_array_equal(np.asarray(b), np.arange(8.0))


# Each case printed as one JSON line; a crash ends the process before the rest, with its signal.
_CASES = textwrap.dedent(
    """
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp
    from flax import nnx
    import jaxstrategy
    from jaxstrategy import RunOptions

    donate = RunOptions(donate_argnums=(0,))
    strategy = jaxstrategy.MirroredStrategy()
    add = lambda a, b: a + b

    def report(case, value):
        print(json.dumps({"case": case, "value": value}), flush=True)

    x = jnp.arange(8.0)
    a, b = strategy.put(x), strategy.put(x)
    report("two puts of one array", strategy.run(add, args=(a, b), options=donate).tolist())

    tree = strategy.put({"a": x, "b": x})
    report("one tree holding one array twice",
           strategy.run(lambda t: t["a"] + t["b"], args=(tree,), options=donate).tolist())

    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    ema = nnx.clone(model)  # Holds the model's arrays.
    strategy.put(model), strategy.put(ema)
    before = ema.kernel[...].tolist()

    def step(model, ema):
        model.kernel[...] = model.kernel[...] + 1.0
        return ema.kernel[...]

    seen = strategy.run(step, args=(model, ema), options=donate).tolist()
    report("flax's EMA pattern", [seen == before, ema.kernel[...].tolist() == before])

    a, b = jax.device_put(x, strategy.sharding), jax.device_put(x, strategy.sharding)
    try:
        strategy.run(add, args=(a, b), options=donate)
        report("two device_puts of one array", "ran")
    except ValueError as error:
        report("two device_puts of one array", str(error))
    """
)


@pytest.mark.slow
def test_buffers_shared_across_four_devices_are_refused_or_never_made_instead_of_crashing():
    result = subprocess.run([sys.executable, "-c", _CASES], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}"
    cases = {line["case"]: line["value"] for line in map(json.loads, result.stdout.splitlines())}
    assert cases["two puts of one array"] == (2 * np.arange(8.0)).tolist()
    assert cases["one tree holding one array twice"] == (2 * np.arange(8.0)).tolist()
    assert cases["flax's EMA pattern"] == [True, True]
    assert "share a device buffer" in cases["two device_puts of one array"]
    assert "args[0] is donated" in cases["two device_puts of one array"]
