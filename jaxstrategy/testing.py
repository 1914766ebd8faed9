"""Helpers for testing code that uses jaxstrategy, in the manner of chex.

`assert_tree_on_strategy` checks placement leaf by leaf; `force_cpu_devices` gives a test process
several CPU devices; `run_local_workers` runs a program as the processes of a multi-worker job on
this machine. Installing jaxstrategy also installs a pytest plugin with the fixtures
`one_device_strategy` and `strategy` (parametrized over every strategy the process can build).
"""

from jaxstrategy._src.cluster.local_workers import run_local_workers as run_local_workers
from jaxstrategy._src.strategies.testing import assert_tree_on_strategy as assert_tree_on_strategy
from jaxstrategy._src.strategies.testing import force_cpu_devices as force_cpu_devices

__all__ = ("assert_tree_on_strategy", "force_cpu_devices", "run_local_workers")
