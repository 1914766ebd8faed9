"""Fixtures shared by the test modules."""

import jax
import pytest

import jaxstrategy


@pytest.fixture
def cpu_devices() -> list[jax.Device]:
    devices = jax.devices("cpu")
    assert len(devices) >= 2, "the root conftest forces 4 CPU devices"
    return devices


@pytest.fixture
def strategy_cpu1() -> jaxstrategy.OneDeviceStrategy:
    """A strategy whose device is not JAX's default device, so misplacement shows."""
    return jaxstrategy.OneDeviceStrategy("/cpu:1")
