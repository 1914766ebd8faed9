"""`ShardedStrategy`: per-replica code over models split across each replica's devices.

A `ShardedPlacement` (`sharded_placement.py`) over this process's devices, and this process
alone as the job. This is TensorFlow's `TPUStrategy` with SPMD partitioning, on any backend: each
replica runs `fn` on its batch while XLA splits the replica's work over its devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
from jax.sharding import NamedSharding

from jaxstrategy._src.core.device_spec import resolve_devices, spans_processes
from jaxstrategy._src.core.types import DeviceLike, PyTree
from jaxstrategy._src.strategies.job import ONE_PROCESS
from jaxstrategy._src.strategies.layout_rules import (
    DEFAULT_MIN_SHARD_BYTES,
    LayoutDescription,
    LayoutRules,
    as_spec,
)
from jaxstrategy._src.strategies.sharded_placement import ShardedPlacement
from jaxstrategy._src.strategies.strategy import Strategy, get_strategy


class ShardedStrategy(Strategy):
    """Synchronous training of models bigger than one device: replicas of S devices each.

    The devices are split into `num_replicas` groups of S consecutive devices. Each group is one
    replica, as on `MirroredStrategy`: `run` calls `fn` once per replica, a `PerReplica` argument
    gives each replica its part, `jax.grad` gives each replica its own gradient and
    `get_replica_context().all_reduce` combines them across replicas. Within a replica, every
    large leaf of the variables (parameters, optimizer state) is split over the S devices, so
    each device holds about 1/S of the model; inside `fn` the leaves have their full shapes and
    XLA moves what each operation needs. With S = 1 it behaves as `MirroredStrategy`.

    How each leaf is split (see `describe_layout`): a Flax NNX Variable's own annotation
    (`nnx.with_partitioning`) first; then the first of `layout`'s `(regex, spec)` rules whose
    regex matches the leaf's path (keys joined by `/`, such as `dense/kernel`) or a trailing
    part of it, so that the rule for a parameter also lays out its optimizer state; then, for
    outputs of `run` and `init`, the layout of the input they replace; else the default: the
    largest dimension that S divides, for leaves of at least `min_shard_bytes`. Specs name the
    axes `'shard'` and `'model'`.

    Tensor parallelism: with `model_parallel=M`, each replica's S x M devices form a mesh
    `('shard', 'model')`, M innermost. Only what a rule or an annotation names is split over
    `'model'` (in a Megatron-style MLP, the first kernel's output dimension and the second's
    input dimension), and `jaxstrategy.with_sharding_constraint` lays activations out over it
    inside the step. Without a `'model'` axis a spec's `'model'` entries are dropped, so one
    layout serves both. For a job of several processes, see `MultiWorkerShardedStrategy`.

    Create big models with `init`, which compiles the initializer so that every leaf is made
    already split; `put` splits a tree that is on the host.

    Args:
      devices: the devices, in any form `MirroredStrategy` accepts; None means every local
        device. Their count must be a multiple of `num_replicas`.
      num_replicas: R, how many replicas (groups of devices).
      model_parallel: M, how many of each replica's devices split the layers that rules name
        over `'model'`; it must divide the devices per replica. 1: no `'model'` axis.
      layout: `(regex, spec)` rules, such as `[('.*/kernel', PartitionSpec(None, 'shard'))]`;
        specs name `'shard'`, `'model'` or None per dimension.
      min_shard_bytes: leaves smaller than this are replicated by the default rule (256 KiB, as
        TensorFlow's `MinSizePartitioner`).

    Raises:
      ValueError: `num_replicas` does not divide the number of devices, or `model_parallel`
        a replica's; a layout rule is malformed (see `LayoutRules`); the devices span several
        processes (use `MultiWorkerShardedStrategy`).
      InvalidDeviceError: as for `MirroredStrategy`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.ShardedStrategy(['/cpu:0', '/cpu:1'], min_shard_bytes=0)
      >>> strategy.num_replicas_in_sync, strategy.devices_per_replica
      (1, 2)
      >>> params = strategy.init(lambda: {'w': jnp.ones((4, 2)), 'b': jnp.zeros(2)})
      >>> [shard.data.shape for shard in params['w'].addressable_shards]  # Half of w each.
      [(2, 2), (2, 2)]
      >>> def step(params, x):
      ...     grads = jax.grad(lambda p: jnp.sum(x @ p['w'] + p['b']))(params)
      ...     return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
      >>> new = strategy.run(step, args=(params, jnp.ones((3, 4))))
      >>> shapes = [shard.data.shape for shard in new['w'].addressable_shards]
      >>> shapes, round(float(new['w'][0, 0]), 4)
      ([(2, 2), (2, 2)], 0.7)
    """

    def __init__(
        self,
        devices: Sequence[DeviceLike] | None = None,
        *,
        num_replicas: int = 1,
        model_parallel: int = 1,
        layout: Sequence[tuple[str, Any]] | None = None,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    ):
        caller = "ShardedStrategy()"
        resolved = resolve_devices(devices, owner="ShardedStrategy")
        if spans_processes(resolved):
            raise ValueError(
                f"{caller}: the devices span several processes; a ShardedStrategy holds one "
                "process's devices. Use MultiWorkerShardedStrategy for a job of several processes, "
                "or pass this process's devices (jax.local_devices())."
            )
        placement = ShardedPlacement(
            resolved,
            num_replicas=num_replicas,
            model_parallel=model_parallel,
            layout=layout,
            min_shard_bytes=min_shard_bytes,
            caller=caller,
            devices_given=True,
        )
        super().__init__(placement, ONE_PROCESS)

    @property
    def _rules(self) -> LayoutRules:
        return cast(ShardedPlacement, self._placement).rules

    def __repr__(self) -> str:
        rules = self._rules
        return (
            f"{type(self).__name__}(devices={self.devices!r}, num_replicas={self.num_replicas_in_sync}, "
            f"model_parallel={rules.model}, layout={list(rules.rules)!r}, "
            f"min_shard_bytes={rules.min_shard_bytes})"
        )

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device, replica by replica: replica i holds `devices[i*D:(i+1)*D]`, where D is
        `devices_per_replica` (S x M)."""
        return self._placement.devices

    @property
    def devices_per_replica(self) -> int:
        """S x M, the devices each replica's variables are split over."""
        return self._rules.devices_per_replica

    @property
    def model_parallel(self) -> int:
        """M, the size of the `'model'` axis (1: no tensor parallelism)."""
        return self._rules.model

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The `jax.sharding.Mesh` of the devices, axes `('replica', 'shard')`, all Auto; with
        `model_parallel` above 1, `('replica', 'shard', 'model')`."""
        return self._placement.mesh

    @property
    def sharding(self) -> NamedSharding:
        """`NamedSharding(mesh, P())`: replicated on every device. Variables are laid out leaf by
        leaf instead: see `layout_of`."""
        return cast(NamedSharding, self._placement.sharding)

    def layout_of(self, tree: PyTree) -> PyTree:
        """The sharding of each leaf of `tree` (arrays, `jax.ShapeDtypeStruct`s, Flax NNX
        Variables or objects) as `put` would place it: a tree of `NamedSharding`s shaped like
        `tree` (an NNX object stands for its state, `nnx.state(obj)`).

        Example:
          >>> import numpy as np, jaxstrategy
          >>> strategy = jaxstrategy.ShardedStrategy(['/cpu:0', '/cpu:1'], min_shard_bytes=64)
          >>> layout = strategy.layout_of({'w': np.zeros((8, 6)), 'b': np.zeros(6)})
          >>> tuple(layout['w'].spec), tuple(layout['b'].spec)
          (('shard', None), ())
        """
        return cast(ShardedPlacement, self._placement).layout_of(tree, f"{type(self).__name__}.layout_of()")

    def describe_layout(self, tree: PyTree) -> LayoutDescription:
        """A table of how `tree`'s leaves are laid out: path, shape, spec, bytes per device and
        what decided it, with the total per device against the replicated total. It also lists
        the layout rules that match no leaf. `PerReplica` leaves (values, not variables) are left
        out: their components live whole on their replicas.

        Example:
          >>> import numpy as np, jaxstrategy
          >>> strategy = jaxstrategy.ShardedStrategy(['/cpu:0', '/cpu:1'], min_shard_bytes=64)
          >>> params = {'w': np.zeros((8, 6), np.float32), 'b': np.zeros(6, np.float32)}
          >>> print(strategy.describe_layout(params))
          path  shape          spec             per device  decided by
          ----  -------------  ---------------  ----------  ----------------------------------------
          b     float32[6]     ()               24 B        replicated: under min_shard_bytes (64 B)
          w     float32[8, 6]  ('shard', None)  96 B        default: largest dimension 2 divides
          per device: 120 B of 216 B replicated (56%), over 2 devices per replica
        """
        return cast(ShardedPlacement, self._placement).describe_layout(
            tree, f"{type(self).__name__}.describe_layout()"
        )


def with_sharding_constraint(x: PyTree, spec: Any) -> PyTree:
    """Lay out an intermediate value (an activation) over the axes of its replica.

    The in-step counterpart of the layout rules, for tensor parallelism: in a Megatron-style MLP
    whose first kernel is split on its output dimension over `'model'` and second on its input
    dimension, `with_sharding_constraint(h, (None, 'model'))` keeps the hidden activation split
    as the kernels are, so XLA adds one reduction per layer pair rather than gathering `h`.
    `spec` names `'shard'`, `'model'` or None per dimension of each leaf of `x`, never
    `'replica'`: inside `run` each replica constrains its own value. On a strategy without those
    axes (`OneDeviceStrategy`, `MirroredStrategy`) it returns `x` unchanged, and without a
    `'model'` axis its `'model'` entries are dropped, so the same step runs on every strategy.

    Args:
      x: an array, or a pytree of arrays, each laid out by `spec`.
      spec: a `PartitionSpec`, or a tuple of its entries.

    Returns:
      `x`, constrained (`jax.lax.with_sharding_constraint` over the strategy's mesh).

    Raises:
      TypeError: `spec` is not a spec.
      ValueError: `spec` names an axis other than `'shard'` and `'model'`, or one twice.

    Example:
      >>> import jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.ShardedStrategy(['/cpu:0', '/cpu:1'], model_parallel=2)
      >>> def hidden(x):
      ...     h = jaxstrategy.with_sharding_constraint(x @ jnp.ones((4, 6)), (None, 'model'))
      ...     return h, jnp.sum(h)
      >>> h, total = strategy.run(hidden, args=(jnp.ones((2, 4)),))
      >>> float(total)
      48.0
    """
    spec = as_spec(spec, where="the activation", caller="jaxstrategy.with_sharding_constraint()")
    return get_strategy()._placement.constrain(x, spec)
