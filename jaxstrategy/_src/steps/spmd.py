"""One SPMD program for all replicas: a step function wrapped in `jax.shard_map` over a mesh axis.

`per_replica_program(fn, ...)` returns a function that, traced by `jax.jit`, runs `fn` once per
replica as a single program: a `PerReplica` argument gives each replica its own component, any
other array is seen whole. Outputs the same on every replica come back replicated, the rest as
`PerReplica`s. docs/internals.md, "Running a step", tells why gradients are TensorFlow's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun
from jax.sharding import PartitionSpec

from jaxstrategy._src.core.errors import bullet_list, format_path
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.steps.replication import varying_outputs
from jaxstrategy._src.values.per_replica import PerReplica, is_per_replica

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
    # On a mesh with other axes (ShardedStrategy's 'shard'), only the replica axis is manual:
    # the compiler splits each replica's work over the others.
    beside_others = len(mesh.axis_names) > 1
    manual: dict[str, Any] = {"axis_names": frozenset({axis_name})} if beside_others else {}
    one_replica_beside_others = beside_others and mesh.shape[axis_name] == 1

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
        varying_inputs = [kind == _PER_REPLICA for kind in kinds if kind != _STATIC]
        outputs: dict[str, Any] = {}

        def replica_fn(*blocks: Any) -> list[jax.Array]:
            block_iter = iter(blocks)
            rebuilt = [_rebuild(leaf, kind, block_iter) for leaf, kind in zip(leaves, kinds, strict=True)]
            call_args, call_kwargs = jax.tree.unflatten(treedef, rebuilt)
            # The replica id is read inside the traced function, so the analysis sees it vary.
            with replica_context(jax.lax.axis_index(axis_name)):
                result = fn(*call_args, **call_kwargs)
            out_leaves, outputs["treedef"] = jax.tree.flatten(result)
            return _as_arrays(out_leaves, outputs["treedef"], caller)

        def body(*blocks: Any) -> tuple[Any, ...]:
            # Traced once to a jaxpr, which says which outputs are replicated, then evaluated.
            traced_fn = jax.make_jaxpr(replica_fn)(*blocks)
            outputs["varying"] = varying_outputs(traced_fn, varying_inputs, axis_name)
            # An output the jaxpr holds as a constant comes back as a Python scalar.
            return tuple(jnp.asarray(x)[None] for x in jaxpr_as_fun(traced_fn)(*blocks))

        if one_replica_beside_others:
            # Bound by a vmap of one: a collective over a manual axis of size 1 beside a
            # compiler-sharded one crashes XLA (measured, JAX 0.10.2). Nothing is mapped over
            # (a PerReplica's one component goes in as it is): batched along a leading axis of
            # one, each matmul became a batched one that XLA split otherwise.
            def one_replica(*values: Any) -> tuple[Any, ...]:
                blocks = [
                    v[None] if per_replica else v
                    for v, per_replica in zip(values, varying_inputs, strict=True)
                ]
                return tuple(x[0] for x in body(*blocks))

            components = [
                v[0] if per_replica else v for v, per_replica in zip(traced, varying_inputs, strict=True)
            ]
            stacked = jax.vmap(one_replica, in_axes=None, axis_name=axis_name, axis_size=1)(*components)
        else:
            # `check_vma=False`: with JAX's replication types, a whole argument meeting a
            # per-replica value gets an implicit `pvary`, whose transpose is a `psum`, so a
            # replica's gradient with respect to a variable would come back summed over the
            # replicas. Without them each replica differentiates its own function, as in
            # TensorFlow.
            stacked = jax.shard_map(
                body, mesh=mesh, in_specs=in_specs, out_specs=stacked_spec, check_vma=False, **manual
            )(*traced)
        varying = outputs["varying"]
        invariant: Sequence[Any] = [x for x, v in zip(stacked, varying, strict=True) if not v]
        if invariant and one_replica_beside_others:
            invariant = [x[0] for x in invariant]
        elif invariant:
            # Each device keeps its own copy of a value shown to be the same everywhere.
            invariant = jax.shard_map(
                lambda *xs: tuple(x[0] for x in xs),
                mesh=mesh,
                in_specs=stacked_spec,
                out_specs=whole_spec,
                check_vma=False,
                **manual,
            )(*invariant)
        unstacked = iter(invariant)
        results = [PerReplica(x) if v else next(unstacked) for x, v in zip(stacked, varying, strict=True)]
        return jax.tree.unflatten(outputs["treedef"], results)

    return program


def _kind(leaf: Any) -> int:
    if isinstance(leaf, PerReplica):
        return _PER_REPLICA
    # Under jax.jit every array argument is a tracer; anything else was made static by the caller.
    return _WHOLE if is_tracer(leaf) else _STATIC


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
