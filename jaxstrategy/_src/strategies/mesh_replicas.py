"""The replicas of a mesh, and the values across them, for the placements that have a mesh.

`MeshReplicas` holds the facts (which replicas this process holds, on which devices; the
replicated and the stacked sharding); the functions reduce, gather, list and make values that
differ between replicas (`PerReplica`s: one array stacked along a new leading axis, split over
the replicas). `ReplicatedPlacement` and `ShardedPlacement` call them, each with its own way of
reading a replica's copy of a leaf and of assembling components.

Everything that is not a `PerReplica` stands for the same value on every replica: `reduce` with
SUM multiplies it by the number of replicas, `gather` concatenates its copies and local results
repeat it, so on one replica all three agree with `OneDeviceStrategy`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxstrategy._src.core.device_spec import spans_processes
from jaxstrategy._src.core.errors import InvalidDeviceError, bullet_list, format_path
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.tree_checks import (
    PYTHON_SCALARS,
    is_array_like,
    require_array_leaves,
    require_representable,
)
from jaxstrategy._src.core.types import PyTree, StepFn, StrategyLike
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps.in_flight import InFlightLimit
from jaxstrategy._src.steps.spmd import REPLICA_AXIS, per_replica_program
from jaxstrategy._src.strategies.placement import ValuesToCompare
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.contexts import ReplicaContext, ValueContext
from jaxstrategy._src.values.per_replica import PerReplica, check_replica_count, components, is_per_replica
from jaxstrategy._src.values.reduce_op import ReduceOp, axes_of_leaves, mean_dtype
from jaxstrategy._src.values.variables import device_put_anywhere, private_copy

# How many `run` steps may be queued on several CPU devices before one is waited for (see
# steps/in_flight.py).
CPU_STEPS_IN_FLIGHT = 8


class MeshReplicas:
    """The replicas of a mesh whose first axis is `'replica'`, as this process sees them.

    A replica is a row of the mesh. It is local where this process holds its devices: all of
    them, or (a replica of a sharded strategy that spans processes) some, the other processes
    holding the rest. The local replicas are consecutive, since each process feeds its own.

    Raises:
      InvalidDeviceError: this process holds no replica, or replicas that are not consecutive.
    """

    def __init__(self, devices: tuple[jax.Device, ...], mesh: jax.sharding.Mesh, *, caller: str):
        self.devices = devices
        self.mesh = mesh
        self.num_replicas: int = mesh.shape[REPLICA_AXIS]
        per_replica = len(devices) // self.num_replicas
        groups = [devices[i * per_replica : (i + 1) * per_replica] for i in range(self.num_replicas)]
        here = jax.process_index()
        local = [i for i, group in enumerate(groups) if any(d.process_index == here for d in group)]
        if not local or local != list(range(local[0], local[-1] + 1)):
            raise InvalidDeviceError(
                f"{caller}: this process (process {here}) must hold one or more consecutive "
                f"replicas of {devices!r}, since each process feeds its own replicas. Order the "
                "devices process by process, and include this process's."
            )
        self.local_replica_ids = range(local[0], local[-1] + 1)
        # The local replicas that other processes hold devices of too.
        self.shared_replica_ids = frozenset(
            i for i in local if any(d.process_index != here for d in groups[i])
        )
        # Each local replica's first device here: where its values are read when it has several.
        self.local_devices = tuple(next(d for d in groups[i] if d.process_index == here) for i in local)
        self.is_multi_process = spans_processes(devices)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.stacked = NamedSharding(mesh, PartitionSpec(REPLICA_AXIS))
        self.combine = jax.jit(_combine, static_argnums=(0, 1, 2), out_shardings=self.replicated)
        self.stack_python_scalars = jax.jit(_stack, out_shardings=self.stacked)

    def holds(self, array: jax.Array) -> bool:
        """Whether `array` is laid out over this mesh."""
        return getattr(array.sharding, "mesh", None) == self.mesh

    @property
    def batch_layout(self) -> ReplicaLayout:
        """Batches split over the replicas, each process placing its own replicas' parts."""
        return ReplicaLayout(
            self.stacked,
            num_replicas=self.num_replicas,
            stacked=True,
            local_replicas=self.local_replica_ids,
            is_multi_process=self.is_multi_process,
        )

    @property
    def in_flight_limit(self) -> InFlightLimit | None:
        several_cpus = len(self.devices) > 1 and self.devices[0].platform == "cpu"
        return InFlightLimit(CPU_STEPS_IN_FLIGHT) if several_cpus else None

    def replica_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
        """`fn` on every replica as one SPMD program (`steps/spmd.py`), in its replica context."""

        def replica_context(replica_id: jax.Array) -> Any:
            return contexts.entered(owner, ReplicaContext(owner, replica_id, axis_name=REPLICA_AXIS))

        return per_replica_program(
            fn, mesh=self.mesh, axis_name=REPLICA_AXIS, replica_context=replica_context, caller=caller
        )


def shardings_with_components(
    tree: PyTree, replicas: MeshReplicas, *, caller: str, describe: Callable[[Any], str] | None
) -> jax.sharding.Sharding | PyTree:
    """A `PerReplica` split over the replicas, the rest replicated: one sharding when `tree` holds
    no `PerReplica`, else a tree of them."""
    check_replica_count(tree, replicas.num_replicas, caller=caller, describe=describe or _describe_tree_path)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_per_replica)
    stacked = [isinstance(leaf, PerReplica) for leaf in leaves]
    if not any(stacked):
        return replicas.replicated
    return jax.tree.unflatten(treedef, [replicas.stacked if s else replicas.replicated for s in stacked])


def combine_leaves(
    kind: str, op: ReduceOp | None, value: PyTree, axis: Any, replicas: MeshReplicas, *, caller: str
) -> PyTree:
    """`reduce` (`kind` "reduce", by `op`) or `gather` of `value` across the replicas, replicated."""
    count = replicas.num_replicas
    check_replica_count(value, count, caller=caller, describe=_describe_value_path)
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
    # What each replica holds, for the checks: a PerReplica's component shape, else the leaf.
    views = [_component_view(leaf) if isinstance(leaf, PerReplica) else leaf for leaf in leaves]
    view_tree = jax.tree.unflatten(treedef, views)
    if axis is None:
        require_array_leaves(view_tree, caller=caller)
        axes: list[tuple[int, ...]] = [()] * len(leaves)
    else:
        why = " to reduce along an axis" if kind == "reduce" else ""
        axes = axes_of_leaves(view_tree, axis, caller=caller, single=kind == "gather", why=why)
    stacked = tuple(isinstance(leaf, PerReplica) for leaf in leaves)
    arrays = [leaf.stacked if isinstance(leaf, PerReplica) else leaf for leaf in leaves]
    # Onto this mesh first (a no-op for what is there already): `combine` pins no inputs.
    shardings = [replicas.stacked if is_stacked else replicas.replicated for is_stacked in stacked]
    arrays = device_put_anywhere(arrays, shardings)
    combined = replicas.combine((kind, op, count), tuple(map(tuple, axes)), stacked, arrays)
    return jax.tree.unflatten(treedef, combined)


def local_results(
    value: PyTree, replicas: MeshReplicas, local_copies: Callable[[Any], tuple[Any, ...]], *, caller: str
) -> tuple[PyTree, ...]:
    """One tree per replica of this process, each leaf's copy or component read by `local_copies`."""
    check_replica_count(value, replicas.num_replicas, caller=caller, describe=_describe_value_path)
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
    if replicas.is_multi_process and any(_is_traced(leaf) for leaf in leaves):
        raise ValueError(
            f"{caller}: called under jax.jit (a leaf is a tracer). Each process's local results "
            "differ, and one jitted program runs on every process, so it cannot return them. "
            "Return the value (the PerReplica) from the jitted function and call "
            "experimental_local_results outside it; reduce and gather work under jax.jit."
        )
    per_leaf = [local_copies(leaf) for leaf in leaves]
    count = len(replicas.local_devices)
    return tuple(jax.tree.unflatten(treedef, [copies[i] for copies in per_leaf]) for i in range(count))


def replicated_copies(leaf: Any, replicas: MeshReplicas) -> tuple[Any, ...]:
    """Each local replica's value of `leaf`: a `PerReplica`'s component, a replicated array's
    copy on the replica's device, or the leaf itself."""
    # Under an outer `jax.jit` (TensorFlow's `tf.function` around run) leaves are tracers:
    # values, not placements, so a component is a slice and a replicated value itself.
    if isinstance(leaf, PerReplica):
        stacked = leaf.stacked
        if is_tracer(stacked):
            return tuple(stacked[i] for i in replicas.local_replica_ids)
        if isinstance(stacked, jax.Array):  # This process's components, each on its device.
            (stacked,) = device_put_anywhere([stacked], replicas.stacked)
            return components(stacked)
        return tuple(stacked[i] for i in replicas.local_replica_ids)  # Host batches stay on the host.
    if is_tracer(leaf):
        return (leaf,) * len(replicas.local_devices)
    if isinstance(leaf, jax.Array) and replicas.holds(leaf) and leaf.sharding.is_fully_replicated:
        by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
        return tuple(by_device[device] for device in replicas.local_devices)
    return (leaf,) * len(replicas.local_devices)


def distribute_values(
    value_fn: Callable[[ValueContext], PyTree],
    replicas: MeshReplicas,
    assemble: Callable[[list[jax.Array]], jax.Array],
    *,
    caller: str,
) -> tuple[PyTree, ValuesToCompare | None]:
    """`value_fn` called for each local replica, its results as `PerReplica` leaves made of the
    components by `assemble`; with what the processes of a job compare, when there are several."""
    if not callable(value_fn):
        raise TypeError(f"{caller}: value_fn must be callable with a ValueContext; got {value_fn!r}.")
    replica_ids = replicas.local_replica_ids
    results = [value_fn(ValueContext(i, replicas.num_replicas)) for i in replica_ids]
    flat = [jax.tree_util.tree_flatten_with_path(result) for result in results]
    treedef: Any = flat[0][1]
    for replica, (_, other) in zip(replica_ids[1:], flat[1:], strict=True):
        if other != treedef:
            raise ValueError(
                f"{caller}: value_fn returned different structures for replica {replica_ids[0]} "
                f"({treedef}) and replica {replica} ({other}); it must return the same structure "
                "for all."
            )
    leaves = []
    for j, (path, _) in enumerate(flat[0][0]):
        replica_values = [paths_and_leaves[j][1] for paths_and_leaves, _ in flat]
        where = format_path("value", path)
        leaves.append(_stack_components(replica_values, where, replicas, assemble, caller))
    value = jax.tree.unflatten(treedef, leaves)
    if not replicas.is_multi_process:
        return value, None
    # Each process checked its own replicas' results; parts of other shapes elsewhere would
    # make global arrays of memory nobody wrote. A replica that spans processes gets its
    # component from each of them: they must agree on its values too, or its devices would
    # hold different "copies" of it.
    shared = {
        str(i): _content_digest(result)
        for i, result in zip(replica_ids, results, strict=True)
        if i in replicas.shared_replica_ids
    }
    return value, ValuesToCompare(_signature(treedef, leaves), shared)


def assemble_on_first_devices(parts: list[jax.Array], replicas: MeshReplicas) -> jax.Array:
    """One array of the replicas' components, each already on its replica's (one) device."""
    shape = (replicas.num_replicas, *parts[0].shape)
    return jax.make_array_from_single_device_arrays(shape, replicas.stacked, [part[None] for part in parts])


def _stack_components(
    replica_values: list[Any],
    where: str,
    replicas: MeshReplicas,
    assemble: Callable[[list[jax.Array]], jax.Array],
    caller: str,
) -> Any:
    """One leaf of `distribute_values`: the replicas' values of it, as a `PerReplica`."""
    replica_ids = replicas.local_replica_ids
    for i, v in zip(replica_ids, replica_values, strict=True):
        require_representable(v, caller=caller, name=f"{where} of replica {i}")
    same_type = all(type(v) is type(replica_values[0]) for v in replica_values)
    if same_type and isinstance(replica_values[0], PYTHON_SCALARS) and not replicas.is_multi_process:
        # Stacked by jit, which keeps them weakly typed, as one device does (a float then takes
        # on the dtype of the array it meets, as a Python float would). A jit needs every
        # replica's value, which one process of several does not have.
        return PerReplica(replicas.stack_python_scalars(*replica_values))
    if not all(is_array_like(v) for v in replica_values):
        if all(v == replica_values[0] for v in replica_values[1:]):
            return replica_values[0]
        raise TypeError(
            f"{caller}: {where} is not an array and differs between replicas "
            f"({', '.join(repr(v) for v in replica_values)}); return arrays, or the same value "
            "for every replica."
        )
    parts = [
        jax.device_put(v if isinstance(v, jax.Array) else np.asarray(private_copy(v)), device)
        for v, device in zip(replica_values, replicas.local_devices, strict=True)
    ]
    kinds = {(part.shape, part.dtype) for part in parts}
    if len(kinds) > 1:
        found = [
            f"replica {i}: {part.dtype}{list(part.shape)}" for i, part in zip(replica_ids, parts, strict=True)
        ]
        raise ValueError(
            f"{caller}: {where} must have the same shape and dtype on every replica, since one "
            f"program runs on all of them; got:{bullet_list(found)}\nTensorFlow allows "
            "components of different shapes; here pad them to one shape and carry a mask of "
            "the real entries (see the README's MirroredStrategy departures)."
        )
    if any(is_tracer(part) for part in parts):  # Under an outer jax.jit.
        if replicas.is_multi_process:
            raise ValueError(
                f"{caller}: called under jax.jit on a strategy of several processes. Each "
                "process makes only its own replicas' values, and one jitted program runs on "
                "every process, so it cannot hold them. Call it outside jax.jit and pass the "
                "PerReplica to the jitted function."
            )
        return PerReplica(jax.lax.with_sharding_constraint(jnp.stack(parts), replicas.stacked))
    return PerReplica(assemble(parts))


def _describe_tree_path(path: Any) -> str:
    return format_path("tree", path)


def _describe_value_path(path: Any) -> str:
    return format_path("value", path)


def _is_traced(leaf: Any) -> bool:
    return is_tracer(leaf.stacked if isinstance(leaf, PerReplica) else leaf)


def _signature(treedef: Any, leaves: list[Any]) -> str:
    """The structure, component shapes and dtypes of a value; the reprs of its other leaves."""
    described = [
        f"{leaf.stacked.dtype}{list(leaf.stacked.shape[1:])}"
        if isinstance(leaf, PerReplica)
        else repr(leaf)[:200]
        for leaf in leaves
    ]
    return f"{treedef}: {', '.join(described)}"


def _content_digest(tree: PyTree) -> str:
    """A digest of a replica's result, its arrays' bytes, shapes and dtypes and its other leaves'
    reprs: what the processes sharing the replica compare."""
    digest = hashlib.blake2b(digest_size=16)
    for leaf in jax.tree.leaves(tree):
        if is_array_like(leaf):
            array = np.asarray(leaf)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


def _component_view(leaf: PerReplica) -> np.ndarray:
    """An array with a component's shape, without memory: what the axis checks need."""
    return np.broadcast_to(np.uint8(0), tuple(leaf.stacked.shape[1:]))


def _stack(*values: Any) -> jax.Array:
    return jnp.stack(values)


def _combine(
    spec: tuple[str, ReduceOp | None, int],
    axes: tuple[tuple[int, ...], ...],
    stacked: tuple[bool, ...],
    arrays: list[Any],
) -> list[jax.Array]:
    """Reduce or gather each leaf across replicas; compiled once per spec, axes and structure."""
    kind, op, count = spec
    results = []
    for array, leaf_axes, is_stacked in zip(arrays, axes, stacked, strict=True):
        x = jnp.asarray(array)
        if kind == "reduce" and op is ReduceOp.MEAN and not is_stacked and not leaf_axes:
            results.append(x)  # The mean of one value on every replica is that value.
            continue
        if not is_stacked:
            x = jnp.broadcast_to(x, (count, *x.shape))
        if kind == "gather":
            (axis,) = leaf_axes
            moved = jnp.moveaxis(x, 0, axis)  # (..., replicas, length, ...) -> (..., replicas * length, ...)
            results.append(moved.reshape(*x.shape[1 : axis + 1], -1, *x.shape[axis + 2 :]))
            continue
        reduced_axes = (0, *(a + 1 for a in leaf_axes))
        if op is ReduceOp.MEAN:
            results.append(jnp.mean(x.astype(mean_dtype(x.dtype)), axis=reduced_axes))
        else:
            results.append(jnp.sum(x, axis=reduced_axes))
    return results
