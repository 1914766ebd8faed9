"""The pytest plugin installed with jaxstrategy: strategy fixtures with no conftest needed.

Registered through the `pytest11` entry point, so pytest loads it in every session of the
environment. It is a top-level module, outside the `jaxstrategy` package, so that loading it
imports only pytest; JAX and jaxstrategy load when a test asks for a fixture (a conftest can still
force CPU devices first, and suites that never use JAX never pay for importing it). A fixture of
the same name in a user's conftest or module overrides these, as pytest always lets local
fixtures override plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from jaxstrategy._src.strategies.strategy import Strategy


def _one_device_default() -> Strategy:
    from jaxstrategy._src.strategies.one_device import OneDeviceStrategy

    return OneDeviceStrategy()


def _one_device_other() -> Strategy:
    import jax

    from jaxstrategy._src.strategies.one_device import OneDeviceStrategy

    devices = jax.local_devices()
    if len(devices) < 2:
        pytest.skip("needs a second local device (jaxstrategy.testing.force_cpu_devices(2) in conftest)")
    return OneDeviceStrategy(devices[-1])


def _mirrored_all() -> Strategy:
    from jaxstrategy._src.strategies.mirrored import MirroredStrategy

    return MirroredStrategy()


def _sharded_two_per_replica() -> Strategy:
    import jax

    from jaxstrategy._src.strategies.sharded import ShardedStrategy

    devices = jax.local_devices()
    if len(devices) < 2 or len(devices) % 2:
        pytest.skip("needs an even number of local devices (jaxstrategy.testing.force_cpu_devices(4))")
    # Leaves from 1 KiB up are split, so that a test's small model is laid out over the devices.
    return ShardedStrategy(devices, num_replicas=len(devices) // 2, min_shard_bytes=1024)


# Every strategy this process can build, by test id. The second one is not JAX's default
# device, so code that places arrays on the default device instead of the strategy's fails; the
# third splits batches over every local device (one replica when there is one device); the
# fourth splits variables over pairs of devices, each pair one replica.
STRATEGY_FACTORIES: dict[str, Callable[[], Strategy]] = {
    "OneDeviceStrategy(default)": _one_device_default,
    "OneDeviceStrategy(other)": _one_device_other,
    "MirroredStrategy(all)": _mirrored_all,
    "ShardedStrategy(2 per replica)": _sharded_two_per_replica,
}


@pytest.fixture
def one_device_strategy() -> Strategy:
    """A `OneDeviceStrategy` on JAX's default device."""
    return _one_device_default()


@pytest.fixture(params=list(STRATEGY_FACTORIES))
def strategy(request: pytest.FixtureRequest) -> Strategy:
    """Every strategy this process can build; a test using it runs once with each."""
    return STRATEGY_FACTORIES[request.param]()
