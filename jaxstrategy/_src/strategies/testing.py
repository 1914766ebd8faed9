"""Test helpers for users' suites: strategy-aware tree assertions and CPU device forcing."""

from __future__ import annotations

import jax

from jaxstrategy._src.core.arguments import check_int
from jaxstrategy._src.core.errors import bullet_list, format_path
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.strategies.strategy import Strategy


def assert_tree_on_strategy(tree: PyTree, strategy: Strategy, *, committed: bool = True) -> None:
    """Assert that every leaf of `tree` is a jax array placed as `strategy` places variables.

    A leaf passes when it lives on exactly the strategy's devices with the strategy's sharding
    (on `ShardedStrategy`: split over the `'shard'` axis of its mesh, or not at all), or, on a
    strategy with several devices, replicated over all of them (which
    `chex.assert_tree_is_on_device` rejects), and, with `committed=True`, is committed (which chex
    does not check). Every bad leaf is reported by its path in one AssertionError.

    Args:
      tree: the pytree to check.
      strategy: the strategy whose placement is expected.
      committed: also require every array to be committed to its devices.

    Raises:
      AssertionError: some leaf is not a jax array, or is placed elsewhere, or is uncommitted.

    Example:
      >>> import jax.numpy as jnp, jaxstrategy
      >>> from jaxstrategy.testing import assert_tree_on_strategy
      >>> strategy = jaxstrategy.OneDeviceStrategy('/cpu:0')
      >>> assert_tree_on_strategy(strategy.put({'w': jnp.ones(2)}), strategy)
      >>> assert_tree_on_strategy({'w': jnp.ones(2)}, strategy)
      Traceback (most recent call last):
      ...
      AssertionError: 1 leaf is not placed on OneDeviceStrategy(device=CpuDevice(id=0)):
        tree['w'] is not committed (pass committed=False to allow that)
    """
    expected_devices = set(strategy.devices)
    problems = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = format_path("tree", path)
        if not isinstance(leaf, jax.Array):
            problems.append(f"{where} is a {type(leaf).__name__}, not a jax array")
            continue
        devices = leaf.devices()
        if devices != expected_devices:
            problems.append(
                f"{where} is on {sorted(devices, key=str)}, not {sorted(expected_devices, key=str)}"
            )
            continue
        replicated = len(expected_devices) > 1 and leaf.sharding.is_fully_replicated
        if not replicated and not strategy._placement.holds_variables_with(leaf.sharding, leaf.ndim):
            problems.append(
                f"{where} has sharding {leaf.sharding}, not one {strategy!r} places variables with"
            )
        elif committed and not leaf.committed:
            problems.append(f"{where} is not committed (pass committed=False to allow that)")
    if problems:
        count = f"{len(problems)} leaf is" if len(problems) == 1 else f"{len(problems)} leaves are"
        raise AssertionError(f"{count} not placed on {strategy!r}:{bullet_list(problems)}")


def force_cpu_devices(n: int) -> None:
    """Make JAX's CPU backend present `n` devices, for multi-device tests on any machine.

    Call it in a `conftest.py` before anything starts JAX's backends (creating an array, listing
    devices, building a strategy); importing jax is fine.

    Raises:
      ValueError: `n` is not an int >= 1.
      RuntimeError: JAX's backends have already started, so the device count is fixed.

    Example:
      In a conftest.py, `force_cpu_devices(4)` before any test runs. Once JAX has started:

      >>> import jax
      >>> from jaxstrategy.testing import force_cpu_devices
      >>> _ = jax.devices()  # Starts the backends.
      >>> force_cpu_devices(4)
      Traceback (most recent call last):
      ...
      RuntimeError: force_cpu_devices(4): JAX has already started its backends in this process, ...
    """
    check_int(n, f"force_cpu_devices({n!r})", at_least=1)
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as error:
        raise RuntimeError(
            f"force_cpu_devices({n}): JAX has already started its backends in this process, so the "
            "number of CPU devices is fixed. Call it at the top of conftest.py, before any code "
            "creates an array, lists devices or builds a strategy; or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before the process starts."
        ) from error
