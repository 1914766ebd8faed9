"""`MeshStrategy`: one replica per device of a one-axis mesh, as one SPMD program over it.

The base of `MirroredStrategy` (the devices of this process) and `MultiWorkerMirroredStrategy`
(the devices of every process of a job). Variables are replicated: one array per leaf,
`NamedSharding(mesh, P())`. `run` is one `jax.jit` of a `jax.shard_map` over the mesh's
`'replica'` axis (see `steps/spmd.py`). Values that differ between replicas are `PerReplica`s:
one array stacked along a new leading axis, sharded over the replicas.

Everything that is not a `PerReplica` stands for the same value on every replica. So `reduce`
with SUM multiplies it by the number of replicas, `gather` concatenates its copies and
`experimental_local_results` returns one copy per replica: on one replica all three agree with
`OneDeviceStrategy`, and a value is treated the same whether JAX could prove it identical on every
replica (and returned it replicated) or not.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxstrategy._src.cluster.coordination import require_same_on_every_process
from jaxstrategy._src.core.device_spec import spans_processes
from jaxstrategy._src.core.errors import (
    InvalidDeviceError,
    bullet_list,
    format_argument_path,
    format_path,
)
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.tree_checks import (
    PYTHON_SCALARS,
    is_array_like,
    require_array_leaves,
    require_representable,
)
from jaxstrategy._src.core.types import PyTree, StepFn
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps.in_flight import InFlightLimit
from jaxstrategy._src.steps.spmd import REPLICA_AXIS, per_replica_program
from jaxstrategy._src.strategies.strategy import Strategy
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.contexts import ReplicaContext, ValueContext
from jaxstrategy._src.values.per_replica import PerReplica, check_replica_count, components, is_per_replica
from jaxstrategy._src.values.reduce_op import ReduceOp, axes_of_leaves, mean_dtype
from jaxstrategy._src.values.variables import device_put_anywhere, private_copy

# How many `run` steps may be queued on several CPU devices before one is waited for (see
# steps/in_flight.py).
_CPU_STEPS_IN_FLIGHT = 8


def _describe_tree_path(path: Any) -> str:
    return format_path("tree", path)


def _describe_value_path(path: Any) -> str:
    return format_path("value", path)


class MeshStrategy(Strategy):
    """What `MirroredStrategy` and `MultiWorkerMirroredStrategy` share: one replica per device of
    a one-axis mesh, variables replicated on all of them, `run` one SPMD program over the mesh.

    The mesh may span several processes. Each process then holds the components of its own
    replicas (its "local" replicas, consecutive in replica order): `experimental_local_results`
    and `experimental_distribute_values_from_function` deal in those, while `reduce`, `gather`
    and `run` work on the whole mesh and give every process the same replicated results.
    """

    def __init__(self, devices: tuple[jax.Device, ...], mesh: jax.sharding.Mesh | None = None):
        """`devices` in replica order; `mesh`, when given, a mesh of them whose first axis is
        `'replica'` (each replica then a row of devices); else one replica per device."""
        self._devices = devices
        self._mesh = mesh if mesh is not None else jax.sharding.Mesh(np.array(devices), (REPLICA_AXIS,))
        self._num_replicas = self._mesh.shape[REPLICA_AXIS]
        per_replica = len(devices) // self._num_replicas
        groups = [devices[i * per_replica : (i + 1) * per_replica] for i in range(self._num_replicas)]
        here = jax.process_index()
        # A replica is local where this process holds its devices: all of them, or (a replica
        # of a sharded strategy that spans processes) some, the other processes holding the rest.
        local = [i for i, group in enumerate(groups) if any(d.process_index == here for d in group)]
        if not local or local != list(range(local[0], local[-1] + 1)):
            raise InvalidDeviceError(
                f"{type(self).__name__}: this process (process {jax.process_index()}) must hold one "
                f"or more consecutive replicas of {devices!r}, since each process feeds its own "
                "replicas. Order the devices process by process, and include this process's."
            )
        self._local_replica_ids = range(local[0], local[-1] + 1)
        # The local replicas that other processes hold devices of too.
        self._shared_replica_ids = frozenset(
            i for i in local if any(d.process_index != here for d in groups[i])
        )
        # Each local replica's first device here: where its values are read when it has several.
        self._local_devices = tuple(next(d for d in groups[i] if d.process_index == here) for i in local)
        self._sharding = NamedSharding(self._mesh, PartitionSpec())
        self._stacked_sharding = NamedSharding(self._mesh, PartitionSpec(REPLICA_AXIS))
        self._combine = jax.jit(_combine, static_argnums=(0, 1, 2), out_shardings=self._sharding)
        self._stack_python_scalars = jax.jit(_stack, out_shardings=self._stacked_sharding)
        super().__init__()

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices, one per replica, in replica order."""
        return self._devices

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._devices == self._devices

    def __hash__(self) -> int:
        return hash((type(self), self._devices))

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which gradients are aggregated."""
        return self._num_replicas

    @property
    def sharding(self) -> NamedSharding:
        """`NamedSharding(mesh, P())`: replicated on every device; where variables live."""
        return self._sharding

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The `jax.sharding.Mesh` of the devices, with one axis, `'replica'`."""
        return self._mesh

    def experimental_local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        """Return one tree per replica of this process, in replica order.

        A `PerReplica` leaf gives each replica its component, and an array replicated on this
        strategy's devices its copy on the replica's device; any other leaf is repeated.
        TensorFlow returns a plain leaf once, as `(value,)`; here it is always one per replica.
        With several processes, each gets its own replicas' values, as in TensorFlow. Of a
        replica of `MultiWorkerShardedStrategy` that spans processes, a value this process
        holds whole (a component, or a variable split only within the process) comes back on
        this process's devices of the replica, and a variable split between the processes as
        the replica's array, of which this process holds its own shards (gather it to the host
        with `jax.experimental.multihost_utils.process_allgather`, on every process).

        Example:
          >>> import jaxstrategy
          >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
          >>> replica_id = lambda: jaxstrategy.get_replica_context().replica_id_in_sync_group
          >>> ids = strategy.run(replica_id)
          >>> [(int(i), i.devices()) for i in strategy.experimental_local_results(ids)]
          [(0, {CpuDevice(id=0)}), (1, {CpuDevice(id=1)})]
        """
        check_replica_count(
            value,
            self._num_replicas,
            caller=f"{type(self).__name__}.experimental_local_results()",
            describe=_describe_value_path,
        )
        leaves, treedef = jax.tree.flatten(value, is_leaf=is_per_replica)
        if self._is_multi_process and any(_is_traced(leaf) for leaf in leaves):
            raise ValueError(
                f"{type(self).__name__}.experimental_local_results(): called under jax.jit (a leaf is "
                "a tracer). Each process's local results differ, and one jitted program runs on "
                "every process, so it cannot return them. Return the value (the PerReplica) from "
                "the jitted function and call experimental_local_results outside it; reduce and "
                "gather work under jax.jit."
            )
        per_leaf = [self._local_copies(leaf) for leaf in leaves]
        count = len(self._local_devices)
        return tuple(jax.tree.unflatten(treedef, [copies[i] for copies in per_leaf]) for i in range(count))

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], PyTree]
    ) -> PyTree:
        """Call `value_fn` once per replica and return its results as `PerReplica` leaves.

        Each replica's component is placed on its own device. Array leaves must have the same
        shape and dtype on every replica (one program runs on all of them); a leaf that is not an
        array must be equal on every replica and is returned as it is. With several processes,
        each process calls `value_fn` for its own replicas only (with their global replica ids)
        and can compare only their results, so results must agree across processes by
        construction; Python numbers become arrays of JAX's default dtypes there, rather than
        weakly typed ones. Processes that share a replica (of a `MultiWorkerShardedStrategy`
        spanning them) each call `value_fn` for it, and must return the same values.

        Raises:
          TypeError: `value_fn` is not callable; a leaf that is not an array differs between
            replicas.
          ValueError: the replicas' results differ in structure, shape or dtype; or processes
            that share a replica gave it different values.

        Example:
          >>> import jaxstrategy
          >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
          >>> value = strategy.experimental_distribute_values_from_function(
          ...     lambda context: context.replica_id_in_sync_group * 10)
          >>> [int(v) for v in strategy.experimental_local_results(value)]
          [0, 10]
        """
        caller = f"{type(self).__name__}.experimental_distribute_values_from_function()"
        if not callable(value_fn):
            raise TypeError(f"{caller}: value_fn must be callable with a ValueContext; got {value_fn!r}.")
        count = self._num_replicas
        replica_ids = self._local_replica_ids
        results = [value_fn(ValueContext(i, count)) for i in replica_ids]
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
            leaves.append(self._stack_components(replica_values, format_path("value", path), caller))
        if self._is_multi_process:
            # Each process checked its own replicas' results; parts of other shapes elsewhere
            # would make global arrays of memory nobody wrote. A replica that spans processes
            # gets its component from each of them: they must agree on its values too, or its
            # devices would hold different "copies" of it.
            shared = {
                str(i): _content_digest(result)
                for i, result in zip(replica_ids, results, strict=True)
                if i in self._shared_replica_ids
            }
            require_same_on_every_process(
                _signature(treedef, leaves),
                what="value_fn's results",
                caller=caller,
                timeout_s=self._batch_layout.input_timeout_s,
                shared=shared,
            )
        return jax.tree.unflatten(treedef, leaves)

    # Hooks of Strategy.

    @property
    def _run_input_shardings(self) -> Callable[[PyTree], PyTree]:
        return self._run_inputs_layout

    @property
    def _run_output_sharding(self) -> None:
        return None  # The shard_map decides each leaf's sharding.

    @property
    def _run_in_flight_limit(self) -> InFlightLimit | None:
        several_cpus = len(self._devices) > 1 and self._devices[0].platform == "cpu"
        return InFlightLimit(_CPU_STEPS_IN_FLIGHT) if several_cpus else None

    @property
    def _batch_layout(self) -> ReplicaLayout:
        return ReplicaLayout(
            self._stacked_sharding,
            num_replicas=self._num_replicas,
            stacked=True,
            local_replicas=self._local_replica_ids,
            is_multi_process=self._is_multi_process,
        )

    def _replica_program(self, fn: StepFn) -> StepFn:
        def replica_context(replica_id: jax.Array) -> Any:
            return contexts.entered(self, ReplicaContext(self, replica_id, axis_name=REPLICA_AXIS))

        return per_replica_program(
            fn,
            mesh=self._mesh,
            axis_name=REPLICA_AXIS,
            replica_context=replica_context,
            caller=f"{type(self).__name__}.run()",
        )

    def _default_device_scope(self) -> Any:
        return jax.default_device(self._local_devices[0])

    def _shardings_for(
        self, tree: PyTree, *, caller: str, describe: Callable[[Any], str] | None = None
    ) -> jax.sharding.Sharding | PyTree:
        """Where the leaves of `tree` go: a `PerReplica` split over the replicas, the rest
        replicated. One sharding when `tree` holds no `PerReplica`, else a tree of them."""
        check_replica_count(tree, self._num_replicas, caller=caller, describe=describe or _describe_tree_path)
        leaves, treedef = jax.tree.flatten(tree, is_leaf=is_per_replica)
        stacked = [isinstance(leaf, PerReplica) for leaf in leaves]
        if not any(stacked):
            return self._sharding
        return jax.tree.unflatten(treedef, [self._stacked_sharding if s else self._sharding for s in stacked])

    def _run_inputs_layout(self, args_and_kwargs: PyTree) -> jax.sharding.Sharding | PyTree:
        caller = f"{type(self).__name__}.run()"
        return self._shardings_for(args_and_kwargs, caller=caller, describe=format_argument_path)

    def _reduce(self, op: ReduceOp, value: PyTree, axis: Any) -> PyTree:
        return self._combine_leaves("reduce", op, value, axis, caller=f"{type(self).__name__}.reduce()")

    def _gather(self, value: PyTree, axis: int) -> PyTree:
        return self._combine_leaves("gather", None, value, axis, caller=f"{type(self).__name__}.gather()")

    # Helpers.

    def _combine_leaves(
        self, kind: str, op: ReduceOp | None, value: PyTree, axis: Any, *, caller: str
    ) -> PyTree:
        check_replica_count(value, self._num_replicas, caller=caller, describe=_describe_value_path)
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
        # Onto this mesh first (a no-op for what is there already): `_combine` pins no inputs.
        shardings = [self._stacked_sharding if is_stacked else self._sharding for is_stacked in stacked]
        arrays = device_put_anywhere(arrays, shardings)
        spec = (kind, op, self._num_replicas)
        combined = self._combine(spec, tuple(map(tuple, axes)), stacked, arrays)
        return jax.tree.unflatten(treedef, combined)

    def _on_mesh(self, array: jax.Array) -> bool:
        return getattr(array.sharding, "mesh", None) == self._mesh

    def _local_copies(self, leaf: Any) -> tuple[Any, ...]:
        # Under an outer `jax.jit` (TensorFlow's `tf.function` around run) leaves are tracers:
        # values, not placements, so a component is a slice and a replicated value itself.
        if isinstance(leaf, PerReplica):
            stacked = leaf.stacked
            if is_tracer(stacked):
                return tuple(stacked[i] for i in self._local_replica_ids)
            if isinstance(stacked, jax.Array):  # This process's components, each on its device.
                (stacked,) = device_put_anywhere([stacked], self._stacked_sharding)
                return components(stacked)
            return tuple(stacked[i] for i in self._local_replica_ids)  # Host batches stay on the host.
        if is_tracer(leaf):
            return (leaf,) * len(self._local_devices)
        if isinstance(leaf, jax.Array) and self._on_mesh(leaf) and leaf.sharding.is_fully_replicated:
            by_device = {shard.device: shard.data for shard in leaf.addressable_shards}
            return tuple(by_device[device] for device in self._local_devices)
        return (leaf,) * len(self._local_devices)

    @property
    def _is_multi_process(self) -> bool:
        return spans_processes(self._devices)

    def _stack_components(self, replica_values: list[Any], where: str, caller: str) -> Any:
        for i, v in zip(self._local_replica_ids, replica_values, strict=True):
            require_representable(v, caller=caller, name=f"{where} of replica {i}")
        same_type = all(type(v) is type(replica_values[0]) for v in replica_values)
        if same_type and isinstance(replica_values[0], PYTHON_SCALARS) and not self._is_multi_process:
            # Stacked by jit, which keeps them weakly typed, as one device does (a float then
            # takes on the dtype of the array it meets, as a Python float would). A jit needs
            # every replica's value, which one process of several does not have.
            return PerReplica(self._stack_python_scalars(*replica_values))
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
            for v, device in zip(replica_values, self._local_devices, strict=True)
        ]
        kinds = {(part.shape, part.dtype) for part in parts}
        if len(kinds) > 1:
            found = [
                f"replica {i}: {part.dtype}{list(part.shape)}"
                for i, part in zip(self._local_replica_ids, parts, strict=True)
            ]
            raise ValueError(
                f"{caller}: {where} must have the same shape and dtype on every replica, since one "
                f"program runs on all of them; got:{bullet_list(found)}\nTensorFlow allows "
                "components of different shapes; here pad them to one shape and carry a mask of "
                "the real entries (see the README's MirroredStrategy departures)."
            )
        if any(is_tracer(part) for part in parts):  # Under an outer jax.jit.
            if self._is_multi_process:
                raise ValueError(
                    f"{caller}: called under jax.jit on a strategy of several processes. Each "
                    "process makes only its own replicas' values, and one jitted program runs on "
                    "every process, so it cannot hold them. Call it outside jax.jit and pass the "
                    "PerReplica to the jitted function."
                )
            return PerReplica(jax.lax.with_sharding_constraint(jnp.stack(parts), self._stacked_sharding))
        return PerReplica(self._assemble_components(parts))

    def _assemble_components(self, parts: list[jax.Array]) -> jax.Array:
        """One array of the replicas' components, each already on its replica's device."""
        shape = (self._num_replicas, *parts[0].shape)
        stacked_parts = [part[None] for part in parts]
        return jax.make_array_from_single_device_arrays(shape, self._stacked_sharding, stacked_parts)


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
