"""`PerReplica`: a value with one component per replica, stored as one sharded JAX array.

TensorFlow keeps a tuple of per-device tensors. Here the components are stacked along a new
leading axis into one global array sharded over the mesh's replica axis, so component `i` is
`stacked[i]` and lives on replica `i`'s device. One array per leaf is what `jax.jit` and
`jax.shard_map` take without any per-call assembly: `run` hands each replica its block, and
`reduce` and `gather` are single XLA computations over the stacked array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jaxstrategy._src.core.errors import bullet_list
from jaxstrategy._src.core.jax_compat import is_tracer


class PerReplica:
    """One value per replica: what `run` returns for outputs that differ between replicas, and
    what distributed datasets yield on strategies with several replicas.

    Pass it back to `run` and each replica gets its own component; combine it with
    `strategy.reduce` or `strategy.gather`, or take its components with
    `strategy.experimental_local_results`. Like TensorFlow's, it has no arithmetic: `v + 1` is a
    TypeError, because it is not one array but several.

    It is a pytree with one child, `stacked`: the components stacked along a new leading axis,
    as one array sharded over the replicas (a numpy array when a dataset keeps its batches on the
    host). `jax.tree.map` therefore maps over the stacked array.

    Attributes:
      shape: one component's shape: what each replica's `fn` sees inside `run` (the per-replica
        batch of a distributed dataset, say). TensorFlow's has none; here, so that code that
        inspects a batch or an `element_spec` runs on one device and on many alike.
      dtype: the components' dtype.
      ndim: one component's number of dimensions.
      stacked: the components stacked along axis 0; `stacked[i]` is replica `i`'s.
      values: the components, as a tuple in replica order (TensorFlow's attribute). When
        `stacked` is split one component per device, as `run` and datasets make it, each is on
        its replica's device; otherwise each is a slice of `stacked`, wherever that is.

    Example:
      >>> import jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
      >>> value = strategy.experimental_distribute_values_from_function(
      ...     lambda context: jnp.float32(context.replica_id_in_sync_group))
      >>> value
      PerReplica:{
        0: Array(0., dtype=float32),
        1: Array(1., dtype=float32)
      }
      >>> value.stacked.shape, [v.devices() for v in value.values]
      ((2,), [{CpuDevice(id=0)}, {CpuDevice(id=1)}])
      >>> value.shape, value.dtype.name
      ((), 'float32')
    """

    __slots__ = ("_stacked",)

    def __init__(self, stacked: Any):
        self._stacked = stacked

    @property
    def stacked(self) -> Any:
        return self._stacked

    @property
    def values(self) -> tuple[Any, ...]:
        return components(self._stacked)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._stacked.shape[1:])

    @property
    def dtype(self) -> Any:
        return self._stacked.dtype

    @property
    def ndim(self) -> int:
        return len(self._stacked.shape) - 1

    def __repr__(self) -> str:
        if not _is_concrete(self._stacked):  # A tracer or a ShapeDtypeStruct has no components.
            return f"PerReplica(stacked={self._stacked!r})"
        lines = [f"  {i}: {component!r}" for i, component in enumerate(self.values)]
        return "PerReplica:{\n" + ",\n".join(lines) + "\n}"

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise _one_value_error("used as one array")

    # `float(loss)` is the first thing tried on a loss that was not all-reduced; Python would say
    # only that a PerReplica is not a number, and `if loss:` would be silently true.
    def __float__(self) -> float:
        raise _one_value_error("turned into one float")

    def __int__(self) -> int:
        raise _one_value_error("turned into one int")

    def __bool__(self) -> bool:
        raise _one_value_error("used as one truth value")


def _one_value_error(use: str) -> TypeError:
    return TypeError(
        f"A PerReplica holds one value per replica, so it cannot be {use}. Take its components "
        "with strategy.experimental_local_results(value), combine them with strategy.reduce(...) "
        "or strategy.gather(...) (or all-reduce the value inside run, as a loss usually is), or "
        "pass it to strategy.run, which gives each replica its own component."
    )


jax.tree_util.register_pytree_node(
    PerReplica,
    lambda value: ((value.stacked,), None),
    lambda _, children: PerReplica(*children),
)


def is_per_replica(x: Any) -> bool:
    """Whether `x` is a `PerReplica`: the `is_leaf` that stops pytree functions at one."""
    return isinstance(x, PerReplica)


def components(stacked: Any) -> tuple[Any, ...]:
    """The per-replica components of a stacked array, in replica order.

    For a JAX array split one component per device (as `run` and the datasets make them), each
    component is read from the shard on its own device, so it stays there, committed; only this
    process's replicas are returned. Any other array is sliced: a numpy array into views, a JAX
    array laid out otherwise (replicated, say) into arrays where it is.
    """
    if isinstance(stacked, jax.Array) and _one_component_per_shard(stacked):
        shards = sorted(stacked.addressable_shards, key=lambda shard: shard.index[0].start)
        return tuple(shard.data[0] for shard in shards)
    return tuple(stacked[i] for i in range(len(stacked)))


def _one_component_per_shard(stacked: jax.Array) -> bool:
    starts = set()
    for shard in stacked.addressable_shards:
        rows = shard.index[0] if shard.index else slice(None)
        if rows.start is None or rows.stop != rows.start + 1:
            return False
        starts.add(rows.start)
    return len(starts) == len(stacked.addressable_shards)


def check_replica_count(tree: Any, count: int, *, caller: str, describe: Callable[[Any], str]) -> None:
    """Raise a ValueError naming every `PerReplica` in `tree` whose component count is not `count`.

    `describe` turns a leaf's key path into its name in the message, such as `value['loss']`.
    """

    def problem(leaf: Any) -> str | None:
        shape = np.shape(leaf.stacked)
        if not shape:
            return "holds a scalar, with no axis of components"
        return None if shape[0] == count else f"has {shape[0]} component(s)"

    leaves = jax.tree.leaves(tree, is_leaf=is_per_replica)
    if all(problem(leaf) is None for leaf in leaves if isinstance(leaf, PerReplica)):
        return
    wrong = [
        f"{describe(path)} {problem(leaf)}"
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_per_replica)[0]
        if isinstance(leaf, PerReplica) and problem(leaf) is not None
    ]
    raise ValueError(
        f"{caller}: this strategy has {count} replica(s), so a PerReplica must have one "
        f"component per replica, but:{bullet_list(wrong)}\nA PerReplica belongs to the strategy "
        "that made it (its run, datasets or experimental_distribute_values_from_function). "
        "Take its components with that strategy's experimental_local_results and build the "
        "value for this one, for example with experimental_distribute_values_from_function."
    )


def _is_concrete(x: Any) -> bool:
    return isinstance(x, np.ndarray) or (isinstance(x, jax.Array) and not is_tracer(x))
