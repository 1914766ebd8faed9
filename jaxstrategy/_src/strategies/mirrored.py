"""`MirroredStrategy`: the same code on many local devices, as one SPMD program over a mesh.

A `ReplicatedPlacement` (`replicated.py`) over the devices of this process that the user names,
and this process alone as the job.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax  # noqa: F401  (`DeviceLike` names `jax.Device`: the docs resolve the signature here)

from jaxstrategy._src.core.device_spec import resolve_devices
from jaxstrategy._src.core.errors import caller_stacklevel
from jaxstrategy._src.core.types import DeviceLike
from jaxstrategy._src.strategies.job import ONE_PROCESS
from jaxstrategy._src.strategies.replicated import ReplicatedPlacement
from jaxstrategy._src.strategies.strategy import Strategy


class MirroredStrategy(Strategy):
    """Synchronous training on several devices of this process: one replica per device.

    Code written for `OneDeviceStrategy` runs unchanged. Variables made with `put`, `init` or a
    checkpoint restore are replicated on every device. `run` traces its function once and runs it
    on every replica as one SPMD program (`jax.jit` of `jax.shard_map`): a `PerReplica` argument,
    such as a batch from a distributed dataset, gives each replica its own part, and any other
    argument is seen whole by every replica. Inside, `jax.grad` gives each replica its own
    gradient, as in TensorFlow, and `get_replica_context().all_reduce('mean', grads)` averages
    them across replicas. Outputs that may differ between replicas come back as `PerReplica`;
    outputs that are provably the same on every replica (all-reduced values, or values computed
    only from those and replicated inputs) come back as replicated arrays.

    Args:
      devices: the devices, in any form `OneDeviceStrategy` accepts, as a list or tuple; None
        (or an empty list) means every local device of JAX's default backend.
      cross_device_ops: accepted for TensorFlow compatibility; XLA chooses how to communicate, so
        anything but None has no effect and warns.

    Raises:
      InvalidDeviceError: (a `ValueError`) a device cannot be parsed or does not exist here, a
        device is listed twice, or the devices are of different kinds.
      TypeError: `devices` is not a list or tuple (a single string, say).

    Example:
      >>> import jax, jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
      >>> strategy.num_replicas_in_sync
      2
      >>> def step(x):
      ...     context = jaxstrategy.get_replica_context()
      ...     return context.all_reduce('sum', x + context.replica_id_in_sync_group)
      >>> print(strategy.run(step, args=(1,)))
      3
      >>> dataset = strategy.experimental_distribute_dataset([jnp.arange(4)])
      >>> batch = next(iter(dataset))
      >>> [part.tolist() for part in strategy.experimental_local_results(batch)]
      [[0, 1], [2, 3]]
    """

    def __init__(self, devices: Sequence[DeviceLike] | None = None, cross_device_ops: Any = None):
        if cross_device_ops is not None:
            warnings.warn(
                "MirroredStrategy(cross_device_ops=...) has no effect: XLA chooses how replicas "
                "communicate. Leave it out.",
                stacklevel=caller_stacklevel(),
            )
        resolved = resolve_devices(devices, owner="MirroredStrategy")
        super().__init__(ReplicatedPlacement(resolved, caller="MirroredStrategy()"), ONE_PROCESS)

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={self.devices!r})"
