"""One SPMD program for all replicas: a step function wrapped in `jax.shard_map` over a mesh axis.

`per_replica_program(fn, ...)` returns a function that, traced by `jax.jit`, runs `fn` once per
replica as a single program. A `PerReplica` argument gives each replica its own component; every
other array argument is seen whole by every replica; non-array leaves (static arguments) are
closed over. `fn` is traced once.

Each output comes back as a `PerReplica` unless JAX's type system shows it is the same on every
replica (it does not vary over the axis: an `all_reduce` result, or a value computed only from
arguments every replica sees whole); those come back as ordinary replicated arrays. `shard_map`
needs its `out_specs` before tracing, so every output first leaves stacked along a new replica
axis; the ones found invariant are then unstacked by a second `shard_map` in which each device
keeps its own copy (`out_specs=P()` with the check off, which the recorded type justifies), so
no data moves between devices.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxstrategy._src.errors import bullet_list, format_path
from jaxstrategy._src.per_replica import PerReplica, is_per_replica
from jaxstrategy._src.types import PyTree

# The mesh axis that holds the replicas, named in collectives inside `run`.
REPLICA_AXIS = "replica"

_PER_REPLICA, _WHOLE, _STATIC = 0, 1, 2


def per_replica_program(
    fn: Callable[..., PyTree],
    *,
    mesh: jax.sharding.Mesh,
    axis_name: str,
    replica_context: Callable[[jax.Array], contextlib.AbstractContextManager[Any]],
    caller: str,
) -> Callable[..., PyTree]:
    """Wrap `fn` to run on every replica of `mesh` along `axis_name`, when traced by `jax.jit`.

    Args:
      fn: the per-replica function.
      mesh: the mesh whose `axis_name` axis holds the replicas.
      axis_name: the replica axis, named in collectives.
      replica_context: given the traced replica id, returns the context `fn` runs in.
      caller: the call to name in messages, such as `MirroredStrategy.run()`.

    Returns:
      A function of the same arguments returning `fn`'s outputs, each leaf a `PerReplica` of the
      replicas' values or, where it is the same on every replica, a replicated array.
    """
    stacked_spec, whole_spec = PartitionSpec(axis_name), PartitionSpec()

    def program(*args: Any, **kwargs: Any) -> PyTree:
        leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=is_per_replica)
        kinds = [_kind(leaf) for leaf in leaves]
        traced = [
            leaf.stacked if kind == _PER_REPLICA else leaf
            for leaf, kind in zip(leaves, kinds, strict=True)
            if kind != _STATIC
        ]
        in_specs = tuple(
            stacked_spec if kind == _PER_REPLICA else whole_spec for kind in kinds if kind != _STATIC
        )
        outputs: dict[str, Any] = {}

        def body(*blocks: Any) -> tuple[Any, ...]:
            block_iter = iter(blocks)
            rebuilt = [_rebuild(leaf, kind, block_iter) for leaf, kind in zip(leaves, kinds, strict=True)]
            call_args, call_kwargs = jax.tree.unflatten(treedef, rebuilt)
            with replica_context(jax.lax.axis_index(axis_name)):
                result = fn(*call_args, **call_kwargs)
            out_leaves, outputs["treedef"] = jax.tree.flatten(result)
            out_leaves = _as_arrays(out_leaves, outputs["treedef"], caller)
            outputs["varying"] = [_varies(x, axis_name) for x in out_leaves]
            return tuple(x[None] for x in out_leaves)

        stacked = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=stacked_spec)(*traced)
        varying = outputs["varying"]
        invariant: Sequence[Any] = [x for x, v in zip(stacked, varying, strict=True) if not v]
        if invariant:
            # Each device keeps its own copy of a value JAX showed to be the same everywhere.
            invariant = jax.shard_map(
                lambda *xs: tuple(x[0] for x in xs),
                mesh=mesh,
                in_specs=stacked_spec,
                out_specs=whole_spec,
                check_vma=False,
            )(*invariant)
        unstacked = iter(invariant)
        results = [PerReplica(x) if v else next(unstacked) for x, v in zip(stacked, varying, strict=True)]
        return jax.tree.unflatten(outputs["treedef"], results)

    return program


def _kind(leaf: Any) -> int:
    if isinstance(leaf, PerReplica):
        return _PER_REPLICA
    # Under jax.jit every array argument is a tracer; anything else was made static by the caller.
    return _WHOLE if isinstance(leaf, jax.core.Tracer) else _STATIC


def _rebuild(leaf: Any, kind: int, blocks: Iterator[Any]) -> Any:
    """The argument leaf one replica sees: its own component of a `PerReplica`, the whole array
    otherwise, or the static value itself."""
    if kind == _STATIC:
        return leaf
    block = next(blocks)
    return block[0] if kind == _PER_REPLICA else block


def _as_arrays(leaves: list[Any], treedef: Any, caller: str) -> list[Any]:
    arrays, bad = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array):
            arrays.append(leaf)
        else:
            try:
                arrays.append(jnp.asarray(leaf))
            except TypeError:
                bad.append(i)
    if bad:
        paths = [
            path for path, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, leaves))[0]
        ]
        lines = [f"{format_path('output', paths[i])} is a {type(leaves[i]).__name__}" for i in bad]
        raise TypeError(f"{caller}: the function must return a pytree of arrays, but:{bullet_list(lines)}")
    return arrays


def _varies(x: jax.Array, axis_name: str) -> bool:
    """Whether JAX's type of `x`, inside `shard_map`, says it may differ between replicas."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax 0.10 and later.
    varying = manual.varying if manual is not None else getattr(aval, "vma", None)
    return True if varying is None else axis_name in varying
