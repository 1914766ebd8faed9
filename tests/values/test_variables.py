"""put and init: variables committed to the strategy, never aliasing host memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import OneDeviceStrategy


def test_put_does_not_alias_numpy_memory(strategy_cpu1):
    host = np.zeros(1024, np.float32)  # large and aligned: JAX would share this buffer on CPU
    variable = strategy_cpu1.put(host)
    host[:] = 7.0
    assert float(variable.sum()) == 0.0


def test_put_keeps_the_tree_structure(strategy_cpu1):
    tree = {"layers": [(np.ones(2), 1.0), (np.zeros(3), 2)], "none": None}
    placed = strategy_cpu1.put(tree)
    assert jax.tree.structure(placed) == jax.tree.structure(tree)
    assert all(leaf.devices() == {strategy_cpu1.device} for leaf in jax.tree.leaves(placed))


def test_put_of_arrays_committed_elsewhere_moves_them(strategy_cpu1, cpu_devices):
    elsewhere = jax.device_put(jnp.arange(3), cpu_devices[0])
    assert strategy_cpu1.put(elsewhere).devices() == {strategy_cpu1.device}


def test_put_names_every_leaf_that_is_not_an_array(strategy_cpu1):
    with pytest.raises(
        TypeError,
        match=r"put\(\): every leaf must be an array:\n  tree\['name'\] is a str\n  tree\['obj'\] is a object$",
    ):
        strategy_cpu1.put({"w": np.ones(2), "name": "layer", "obj": object()})


def test_put_inside_run_is_an_error(strategy_cpu1):
    with pytest.raises(jaxstrategy.StrategyContextError, match=r"put\(\) requires the cross-replica") as err:
        strategy_cpu1.run(lambda x: strategy_cpu1.put(x), args=(1.0,))
    assert "Call put() outside run()" in str(err.value)


def test_init_sees_the_strategy_and_compiles_once(strategy_cpu1):
    seen = []

    def make_params(key, width):
        seen.append(jaxstrategy.get_strategy())
        return {"w": jax.random.normal(key, (width, width)), "b": jnp.zeros(width)}

    first = strategy_cpu1.init(make_params, jax.random.key(0), width=4)
    second = strategy_cpu1.init(make_params, jax.random.key(1), width=4)
    assert seen == [strategy_cpu1], "init traced once, inside the strategy"
    assert first["w"].shape == (4, 4) and not np.allclose(first["w"], second["w"])
    assert all(leaf.committed and leaf.devices() == {strategy_cpu1.device} for leaf in jax.tree.leaves(first))


def test_init_rejects_a_non_callable():
    with pytest.raises(TypeError, match=r"OneDeviceStrategy.init\(\): fn must be callable; got 3"):
        OneDeviceStrategy().init(3)
