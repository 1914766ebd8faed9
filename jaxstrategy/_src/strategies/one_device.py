"""`OneDeviceStrategy`: the whole `tf.distribute.Strategy` API on one `jax.Device`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.device_spec import resolve_device
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import DeviceLike, PyTree, StepFn
from jaxstrategy._src.steps.spmd import REPLICA_AXIS
from jaxstrategy._src.strategies.strategy import Strategy
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.contexts import ReplicaContext, ValueContext
from jaxstrategy._src.values.reduce_op import ReduceOp, axes_of_leaves, reduce_tree
from jaxstrategy._src.values.variables import place_tree


class OneDeviceStrategy(Strategy):
    """A strategy that runs everything on one device: the API of many devices, tested on one.

    Variables made with `put` or `init` are committed to the device; `run` compiles its
    function once and computes there; the same code then runs on many devices by changing the
    constructor. Two strategies on the same device are equal and share a scope.

    Args:
      device: the device, in any form TensorFlow accepts ('/cpu:0', 'GPU:1', '/device:GPU:0',
        '/job:localhost/replica:0/task:0/device:CPU:0', 'cpu'), or 'cuda:1', 'tpu:0', a local
        device index, or a `jax.Device`. None (the default) means JAX's default device, where
        TensorFlow requires the argument.
      soft_placement: when `device` does not exist in this process, warn and use the default
        device instead of raising. TensorFlow falls back silently by default; here a missing
        device is an error unless you ask for the fall-back.

    Raises:
      InvalidDeviceError: (a `ValueError`) `device` cannot be parsed, or names a device this
        process does not have; the message lists the devices it has.
      TypeError: `device` is of the wrong type, such as a list.

    Example:
      >>> import jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy(device='/cpu:0')
      >>> strategy.extended.worker_devices
      ('/job:localhost/replica:0/task:0/device:CPU:0',)
      >>> def step_fn(x):
      ...     return x * 2
      >>> result = 0
      >>> for i in range(10):
      ...     result += strategy.run(step_fn, args=(i,))
      >>> print(result)
      90
    """

    def __init__(self, device: DeviceLike = None, *, soft_placement: bool = False):
        self._device = resolve_device(device, soft_placement=soft_placement, caller="OneDeviceStrategy")
        self._sharding = jax.sharding.SingleDeviceSharding(self._device)
        self._mesh = jax.sharding.Mesh(np.array([self._device]), (REPLICA_AXIS,))
        super().__init__()

    @property
    def device(self) -> jax.Device:
        """The `jax.Device` this strategy computes on."""
        return self._device

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """`(device,)`: the devices of all replicas."""
        return (self._device,)

    @property
    def sharding(self) -> jax.sharding.SingleDeviceSharding:
        """The `SingleDeviceSharding` of the device: where variables and `run` outputs live."""
        return self._sharding

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """A one-device `jax.sharding.Mesh` with the axis `'replica'`, as multi-device strategies have."""
        return self._mesh

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self._device!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OneDeviceStrategy) and other._device == self._device

    def __hash__(self) -> int:
        return hash((OneDeviceStrategy, self._device))

    def experimental_local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        """Return `(value,)`: with one replica, its only local result.

        Example:
          >>> import jaxstrategy
          >>> jaxstrategy.OneDeviceStrategy().experimental_local_results({'loss': 1.0})
          ({'loss': 1.0},)
        """
        return (value,)

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], PyTree]
    ) -> PyTree:
        """Return `value_fn(ValueContext())` with its array-like leaves placed on the device.

        Other leaves are returned as they are. TensorFlow returns the raw result here.

        Raises:
          TypeError: `value_fn` is not callable.

        Example:
          >>> import jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> value = strategy.experimental_distribute_values_from_function(
          ...     lambda context: context.num_replicas_in_sync)
          >>> strategy.experimental_local_results(value)[0].tolist()
          1
        """
        if not callable(value_fn):
            raise TypeError(
                "OneDeviceStrategy.experimental_distribute_values_from_function(): value_fn must be "
                f"callable with a ValueContext; got {value_fn!r}."
            )
        value = value_fn(ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1))
        return place_tree(
            value, self._sharding, caller="experimental_distribute_values_from_function()", static_ok=True
        )

    def _replica_program(self, fn: StepFn) -> StepFn:
        def in_replica_context(*args: Any, **kwargs: Any) -> PyTree:
            # The replica axis is bound, of size 1, so that code written for many devices
            # (`lax.psum(x, 'replica')`, `nnx.BatchNorm(axis_name='replica')`) runs here too.
            # Nothing is mapped over (`in_axes=None`), so no operation but a collective over
            # 'replica' sees the axis. The traced leaves go in as arguments, not closed over,
            # so that Variables rebuilt from them may be written inside, as in `shard_map`.
            leaves, treedef = jax.tree.flatten((args, kwargs))
            traced = [i for i, leaf in enumerate(leaves) if is_tracer(leaf)]

            def replica(*values: Any) -> PyTree:
                rebuilt = list(leaves)
                for i, value in zip(traced, values, strict=True):
                    rebuilt[i] = value
                call_args, call_kwargs = jax.tree.unflatten(treedef, rebuilt)
                with contexts.entered(self, ReplicaContext(self, jnp.zeros((), jnp.int32))):
                    return fn(*call_args, **call_kwargs)

            bound = jax.vmap(replica, in_axes=None, axis_name=REPLICA_AXIS, axis_size=1)
            return jax.tree.map(lambda x: x[0], bound(*[leaves[i] for i in traced]))

        return in_replica_context

    def _default_device_scope(self) -> contextlib.AbstractContextManager[Any]:
        return jax.default_device(self._device)

    def _reduce(self, op: ReduceOp, value: PyTree, axis: Any) -> PyTree:
        if axis is None:
            return value
        caller = "OneDeviceStrategy.reduce()"
        placed = place_tree(value, self._sharding, caller=caller, static_ok=True)
        return reduce_tree(op, placed, axis, caller=caller)  # Raises for leaves that are not arrays.

    def _gather(self, value: PyTree, axis: int) -> PyTree:
        axes_of_leaves(value, axis, caller="OneDeviceStrategy.gather()", single=True)
        return value


# `get_strategy()` outside every scope returns a `OneDeviceStrategy` on JAX's default device.
# Registered from here because values/contexts.py, which every strategy module imports, imports none.
contexts.register_strategies(Strategy, default=OneDeviceStrategy)
