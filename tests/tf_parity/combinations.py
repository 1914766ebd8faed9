"""Stand-ins for TF's `strategy_combinations.py`, on the four CPU devices the root conftest forces.

TF's combinations name devices that this machine may not have; each stand-in keeps what the TF
tests rely on (the number of replicas, and whether the device is JAX's default):

- `one_device_strategy`: `OneDeviceStrategy('/cpu:0')`.
- `one_device_strategy_gpu`: `OneDeviceStrategy('/cpu:1')`, a device that is not the default.
- `mirrored_strategy_with_one_cpu`: `MirroredStrategy(['/cpu:0'])`.
- `mirrored_strategy_with_gpu_and_cpu` (and TF's other two-device ones): two CPU devices.
- `mirrored_strategy_with_cpu_1_and_2`: `MirroredStrategy(['/cpu:1', '/cpu:2'])`, as in TF.
- `mirrored_strategy_with_four_cpus`, `multi_worker_mirrored_one_process` (not TF's): four
  replicas, for the checks of strategy_test_lib.py written for any number of replicas.
- `multi_worker_mirrored_2x1_cpu`: a real job of two processes with one CPU device each, run by
  `two_process_worker.py` (its cases are in `two_process_worker.CASES`).

The `distribution` fixture (conftest.py) builds the strategy of a `NamedDistribution` param.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

import jaxstrategy


@dataclasses.dataclass(frozen=True)
class NamedDistribution:
    """A strategy factory with TF's combination name, used as a parametrize value."""

    name: str
    make: Callable[[], jaxstrategy.Strategy]
    num_replicas: int

    def __str__(self) -> str:
        return self.name


def local_replica_ids(strategy: jaxstrategy.Strategy) -> list[int]:
    """The ids of this process's replicas (all of them, with one process)."""
    return [i for i, d in enumerate(strategy.devices) if d.process_index == jax.process_index()]


default_strategy = NamedDistribution("default_strategy", jaxstrategy.get_strategy, 1)
one_device_strategy = NamedDistribution(
    "one_device_strategy", lambda: jaxstrategy.OneDeviceStrategy("/cpu:0"), 1
)
one_device_strategy_gpu = NamedDistribution(
    "one_device_strategy_gpu(cpu:1)", lambda: jaxstrategy.OneDeviceStrategy("/cpu:1"), 1
)
mirrored_strategy_with_one_cpu = NamedDistribution(
    "mirrored_strategy_with_one_cpu", lambda: jaxstrategy.MirroredStrategy(["/cpu:0"]), 1
)
mirrored_strategy_with_gpu_and_cpu = NamedDistribution(
    "mirrored_strategy_with_gpu_and_cpu(cpu:0,cpu:1)",
    lambda: jaxstrategy.MirroredStrategy(["/cpu:0", "/cpu:1"]),
    2,
)
mirrored_strategy_with_two_cpus = NamedDistribution(
    "mirrored_strategy_with_two_cpus", lambda: jaxstrategy.MirroredStrategy(["/cpu:0", "/cpu:1"]), 2
)
mirrored_strategy_with_cpu_1_and_2 = NamedDistribution(
    "mirrored_strategy_with_cpu_1_and_2", lambda: jaxstrategy.MirroredStrategy(["/cpu:1", "/cpu:2"]), 2
)
mirrored_strategy_with_four_cpus = NamedDistribution(
    "mirrored_strategy_with_four_cpus", lambda: jaxstrategy.MirroredStrategy(), 4
)
multi_worker_mirrored_one_process = NamedDistribution(
    "multi_worker_mirrored_one_process(4 cpus)", jaxstrategy.MultiWorkerMirroredStrategy, 4
)

# TF's `all_strategies`: the default, one-device and mirrored ones (TPU and central storage have
# no counterpart; TF's two-GPU strategies would repeat the two-CPU stand-in).
all_strategies = [
    default_strategy,
    one_device_strategy,
    one_device_strategy_gpu,
    mirrored_strategy_with_gpu_and_cpu,
]
# TF's `all_strategies_minus_default`, with the one-CPU mirrored strategy TF's value tests add.
all_strategies_minus_default = [
    one_device_strategy,
    one_device_strategy_gpu,
    mirrored_strategy_with_one_cpu,
    mirrored_strategy_with_gpu_and_cpu,
]
