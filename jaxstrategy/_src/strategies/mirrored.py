"""`MirroredStrategy`: the same code on many local devices, as one SPMD program over a mesh.

What it runs and how its values behave are `MeshStrategy`'s (`mesh.py`); this module chooses the
devices: those of this process that the user names, checked.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax

from jaxstrategy._src.core.device_spec import resolve_device
from jaxstrategy._src.core.errors import InvalidDeviceError, caller_stacklevel
from jaxstrategy._src.core.types import DeviceLike
from jaxstrategy._src.strategies.mesh import MeshStrategy


class MirroredStrategy(MeshStrategy):
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
        super().__init__(resolve_devices(devices, caller="MirroredStrategy"))

    def __repr__(self) -> str:
        return f"MirroredStrategy(devices={self._devices!r})"


def resolve_devices(devices: Sequence[DeviceLike] | None, *, caller: str) -> tuple[jax.Device, ...]:
    """The devices a list names (every local device for None or an empty list), checked: each
    exists, none twice, all of one kind. `caller` is the class to name in messages."""
    if devices is None or (isinstance(devices, list | tuple) and not devices):
        return tuple(jax.local_devices())
    if not isinstance(devices, list | tuple):
        raise TypeError(
            f"{caller}(devices={devices!r}): expected a list or tuple of devices, such as "
            "['/gpu:0', '/gpu:1'], or None for all local devices; got a "
            f"{type(devices).__name__}. For one device, pass a one-element list."
        )
    missing = [f"devices[{i}]" for i, spec in enumerate(devices) if spec is None]
    if missing:
        # OneDeviceStrategy(None) means the default device; in a list, None names no device.
        raise TypeError(
            f"{caller}(devices={list(devices)!r}): {', '.join(missing)} is None, which names "
            "no device. List devices such as '/gpu:0', or pass devices=None for every local device."
        )
    resolved = tuple(
        resolve_device(spec, caller=caller, argument=f"devices[{i}]") for i, spec in enumerate(devices)
    )
    repeated = sorted({repr(d) for d in resolved if resolved.count(d) > 1})
    if repeated:
        raise InvalidDeviceError(
            f"{caller}(devices={list(devices)!r}): {', '.join(repeated)} is listed more than "
            "once; each device holds one replica. List each device once."
        )
    platforms = sorted({d.platform for d in resolved})
    if len(platforms) > 1:
        raise InvalidDeviceError(
            f"{caller}(devices={list(devices)!r}): the devices are of different kinds "
            f"({', '.join(platforms)}); one program runs on all replicas, so use devices of one kind."
        )
    return resolved
