"""`OneDeviceStrategy`: the whole `tf.distribute.Strategy` API on one `jax.Device`, and its placement."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.device_spec import resolve_device
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import DeviceLike, PyTree, StepFn, StrategyLike
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps.spmd import REPLICA_AXIS
from jaxstrategy._src.strategies.job import ONE_PROCESS
from jaxstrategy._src.strategies.placement import Placement, Shardings, ValuesToCompare
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
        resolved = resolve_device(device, soft_placement=soft_placement, owner="OneDeviceStrategy")
        super().__init__(OneDevicePlacement(resolved), ONE_PROCESS)

    @property
    def device(self) -> jax.Device:
        """The `jax.Device` this strategy computes on."""
        return cast(OneDevicePlacement, self._placement).device

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """`(device,)`: the devices of all replicas."""
        return self._placement.devices

    @property
    def sharding(self) -> jax.sharding.SingleDeviceSharding:
        """The `SingleDeviceSharding` of the device: where variables and `run` outputs live."""
        return cast(OneDevicePlacement, self._placement).sharding

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """A one-device `jax.sharding.Mesh` with the axis `'replica'`, as multi-device strategies have."""
        return self._placement.mesh

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self.device!r})"


class OneDevicePlacement(Placement):
    """Everything on one device: variables, inputs and outputs committed to it, one replica."""

    def __init__(self, device: jax.Device):
        self.device = device
        self._sharding = jax.sharding.SingleDeviceSharding(device)
        self._mesh = jax.sharding.Mesh(np.array([device]), (REPLICA_AXIS,))

    @property
    def key(self) -> Hashable:
        return self.device

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return (self.device,)

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._mesh

    @property
    def sharding(self) -> jax.sharding.SingleDeviceSharding:
        return self._sharding

    @property
    def num_replicas(self) -> int:
        return 1

    def default_device(self) -> jax.Device:
        return self.device

    def shardings_for(
        self, tree: PyTree, *, caller: str, describe: Callable[[Any], str] | None = None
    ) -> jax.sharding.Sharding:
        return self._sharding

    def holds_variables_with(self, sharding: jax.sharding.Sharding, ndim: int) -> bool:
        return sharding.is_equivalent_to(self._sharding, ndim)

    def run_input_shardings(self, caller: str) -> Shardings:
        return self._sharding

    @property
    def run_output_sharding(self) -> jax.sharding.Sharding:
        return self._sharding

    @property
    def batch_layout(self) -> ReplicaLayout:
        return ReplicaLayout(self._sharding)

    def replica_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
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
                with contexts.entered(owner, ReplicaContext(owner, jnp.zeros((), jnp.int32))):
                    return fn(*call_args, **call_kwargs)

            bound = jax.vmap(replica, in_axes=None, axis_name=REPLICA_AXIS, axis_size=1)
            return jax.tree.map(lambda x: x[0], bound(*[leaves[i] for i in traced]))

        return in_replica_context

    def reduce(self, op: ReduceOp, value: PyTree, axis: Any, caller: str) -> PyTree:
        if axis is None:
            return value
        placed = place_tree(value, self._sharding, caller=caller, static_ok=True)
        return reduce_tree(op, placed, axis, caller=caller)  # Raises for leaves that are not arrays.

    def gather(self, value: PyTree, axis: int, caller: str) -> PyTree:
        axes_of_leaves(value, axis, caller=caller, single=True)
        return value

    def local_results(self, value: PyTree, caller: str) -> tuple[PyTree, ...]:
        return (value,)

    def distribute_values(
        self, value_fn: Callable[[ValueContext], PyTree], caller: str
    ) -> tuple[PyTree, ValuesToCompare | None]:
        if not callable(value_fn):
            raise TypeError(f"{caller}: value_fn must be callable with a ValueContext; got {value_fn!r}.")
        value = value_fn(ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1))
        return place_tree(value, self._sharding, caller=caller, static_ok=True), None


# `get_strategy()` outside every scope returns a `OneDeviceStrategy` on JAX's default device.
# Registered from here because values/contexts.py, which every strategy module imports, imports none.
contexts.register_strategies(Strategy, default=OneDeviceStrategy)
