"""jaxstrategy.testing and the pytest plugin, including their failing cases and messages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstrategy import OneDeviceStrategy
from jaxstrategy.testing import assert_tree_on_strategy, force_cpu_devices


def test_placed_trees_pass(strategy_cpu1):
    assert_tree_on_strategy(strategy_cpu1.put({"w": np.ones(3), "b": (1.0, np.int32(2))}), strategy_cpu1)
    assert_tree_on_strategy(strategy_cpu1.run(lambda x: {"y": x * 2}, args=(1,)), strategy_cpu1)
    assert_tree_on_strategy({}, strategy_cpu1)


def test_every_bad_leaf_is_reported_by_path(strategy_cpu1, cpu_devices):
    with jax.default_device(cpu_devices[1]):
        uncommitted = jnp.ones(2)
    tree = {
        "good": strategy_cpu1.put(np.ones(2)),
        "elsewhere": jax.device_put(jnp.ones(2), cpu_devices[0]),
        "numpy": np.ones(2),
        "uncommitted": uncommitted,
    }
    with pytest.raises(AssertionError) as info:
        assert_tree_on_strategy(tree, strategy_cpu1)
    assert str(info.value) == (
        "3 leaves are not placed on OneDeviceStrategy(device=CpuDevice(id=1)):\n"
        "  tree['elsewhere'] is on [CpuDevice(id=0)], not [CpuDevice(id=1)]\n"
        "  tree['numpy'] is a ndarray, not a jax array\n"
        "  tree['uncommitted'] is not committed (pass committed=False to allow that)"
    )


def test_uncommitted_arrays_pass_when_allowed(cpu_devices):
    strategy = OneDeviceStrategy(cpu_devices[1])
    with strategy.scope():
        made_in_scope = jnp.ones(2)
    assert_tree_on_strategy(made_in_scope, strategy, committed=False)


def test_a_different_sharding_on_the_right_device_fails(strategy_cpu1):
    mesh = jax.sharding.Mesh(np.array([strategy_cpu1.device, jax.devices()[2]]), ("x",))
    split = jax.device_put(jnp.ones(4), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    with pytest.raises(AssertionError, match=r"tree is on \[CpuDevice\(id=1\), CpuDevice\(id=2\)\]"):
        assert_tree_on_strategy(split, strategy_cpu1)


@pytest.mark.parametrize("n", [0, -1, 1.5, True])
def test_force_cpu_devices_rejects_bad_counts(n):
    with pytest.raises(ValueError, match=r"force_cpu_devices\(.*\): expected an int >= 1"):
        force_cpu_devices(n)


def test_force_cpu_devices_after_jax_started_says_what_to_do():
    jax.devices()
    with pytest.raises(
        RuntimeError, match=r"already started its backends .* at the top of conftest.py, .*XLA_FLAGS="
    ):
        force_cpu_devices(2)


def _clean_env():
    return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


@pytest.mark.slow  # A fresh process.
def test_force_cpu_devices_in_a_fresh_process():
    code = "import jax; from jaxstrategy.testing import force_cpu_devices; force_cpu_devices(3); print(len(jax.devices()))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_clean_env()
    )
    assert done.stdout == "3\n", done.stderr


_USER_TESTS = textwrap.dedent(
    """
    import jax.numpy as jnp
    from jaxstrategy.testing import assert_tree_on_strategy

    def test_variables(strategy):
        assert_tree_on_strategy(strategy.put({"w": jnp.ones(2)}), strategy)

    def test_default(one_device_strategy):
        assert one_device_strategy.num_replicas_in_sync == 1
    """
)


@pytest.mark.slow  # A pytest session in a process of its own.
def test_the_plugin_does_not_load_jax_into_sessions_that_do_not_use_it(tmp_path):
    (tmp_path / "test_plain.py").write_text(
        "import sys\n\ndef test_no_jax():\n    assert 'jax' not in sys.modules\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(),
        cwd=tmp_path,
    )
    assert "1 passed" in done.stdout, done.stdout + done.stderr


@pytest.mark.slow  # A pytest session in a process of its own.
@pytest.mark.parametrize(("devices", "expected"), [(2, "5 passed"), (1, "3 passed, 2 skipped")])
def test_the_pytest_plugin_gives_fixtures_without_a_conftest(tmp_path, devices, expected):
    (tmp_path / "test_user.py").write_text(_USER_TESTS)
    env = _clean_env() | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert expected in done.stdout, done.stdout + done.stderr
    if devices == 1:
        assert "needs a second local device" in done.stdout
        assert "needs an even number of local devices" in done.stdout
