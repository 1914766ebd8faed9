"""`ShardedPlacement`: replicas of S x M devices each, every large leaf split within its replica.

The devices form a mesh `('replica', 'shard'[, 'model'])`, every axis left to the compiler
(Auto). `run` is the replicated placement's program with only the replica axis manual: inside
`fn` variables have their full shapes and XLA gathers and reduces within a replica, while the
collectives of the replica context act across replicas. `layout_rules.py` decides each leaf's
spec; a step's outputs are laid out as the inputs they replace, so it compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxstrategy._src.core.errors import format_argument_path, format_path
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import PyTree, StepFn, StrategyLike
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps import nnx_objects
from jaxstrategy._src.steps.cache import traced_input_layout
from jaxstrategy._src.steps.in_flight import InFlightLimit
from jaxstrategy._src.steps.spmd import REPLICA_AXIS
from jaxstrategy._src.strategies import mesh_replicas
from jaxstrategy._src.strategies.layout_rules import (
    MODEL_AXIS,
    SHARD_AXIS,
    LayoutDescription,
    LayoutRules,
    LeafLayout,
    declared_spec,
    follow_spec,
    path_string,
)
from jaxstrategy._src.strategies.mesh_replicas import MeshReplicas
from jaxstrategy._src.strategies.placement import Placement, Shardings, ValuesToCompare, cross_replica_program
from jaxstrategy._src.values.contexts import ValueContext
from jaxstrategy._src.values.per_replica import PerReplica, check_replica_count
from jaxstrategy._src.values.reduce_op import ReduceOp


class ShardedPlacement(Placement):
    """`devices`, in replica order, as `num_replicas` rows of S x M, each leaf laid out by `rules`.

    Args:
      devices: every device, replica by replica.
      num_replicas: R.
      model_parallel: M, the size of the `'model'` axis (1: no such axis).
      layout: the user's `(regex, spec)` rules.
      min_shard_bytes: the default rule's threshold.
      caller: the constructor to name in messages, such as `ShardedStrategy()`.
      devices_given: whether the user chose the devices (and may choose others).

    Raises:
      ValueError: `num_replicas` or `model_parallel` is not a positive int or does not divide
        the devices; a layout rule is malformed.
    """

    def __init__(
        self,
        devices: tuple[jax.Device, ...],
        *,
        num_replicas: int,
        model_parallel: int,
        layout: Sequence[tuple[str, Any]] | None,
        min_shard_bytes: int,
        caller: str,
        devices_given: bool = False,
    ):
        for name, value in (("num_replicas", num_replicas), ("model_parallel", model_parallel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{caller}: {name} must be a positive int; got {value!r}.")
        if len(devices) % num_replicas:
            raise ValueError(
                f"{caller}: num_replicas={num_replicas} does not divide the {len(devices)} devices; "
                "each replica is a group of equally many devices. Choose num_replicas among "
                f"{_divisors(len(devices))}"
                + (f", or pass devices= with a multiple of {num_replicas} devices." if devices_given else ".")
            )
        per_replica = len(devices) // num_replicas
        if per_replica % model_parallel:
            raise ValueError(
                f"{caller}: model_parallel={model_parallel} does not divide the {per_replica} devices "
                f"of each replica ({len(devices)} devices, num_replicas={num_replicas}); the 'model' "
                f"axis splits each replica's devices. Choose model_parallel among "
                f"{_divisors(per_replica)}, or fewer replicas."
            )
        shards = per_replica // model_parallel
        self.rules = LayoutRules(
            layout, shards=shards, model=model_parallel, min_shard_bytes=min_shard_bytes, caller=caller
        )
        axes = (REPLICA_AXIS, SHARD_AXIS, MODEL_AXIS) if model_parallel > 1 else (REPLICA_AXIS, SHARD_AXIS)
        grid = np.array(devices, dtype=object).reshape(num_replicas, shards, model_parallel)
        if model_parallel == 1:
            grid = grid[..., 0]
        auto = (jax.sharding.AxisType.Auto,) * len(axes)
        self._replicas = MeshReplicas(devices, jax.sharding.Mesh(grid, axes, axis_types=auto), caller=caller)
        self._replica_meshes = tuple(jax.sharding.Mesh(row, axes[1:], axis_types=auto[1:]) for row in grid)

    @property
    def key(self) -> Hashable:
        # P(None) is P(): specs compare without their trailing Nones.
        rules = tuple((source, _without_trailing_nones(spec)) for source, spec in self.rules.rules)
        return (self.devices, self.num_replicas, self.rules.model, rules, self.rules.min_shard_bytes)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._replicas.devices

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self._replicas.mesh

    @property
    def sharding(self) -> NamedSharding:
        return self._replicas.replicated

    @property
    def num_replicas(self) -> int:
        return self._replicas.num_replicas

    @property
    def replicas(self) -> MeshReplicas:
        """Which replicas this process holds, and on which devices."""
        return self._replicas

    def default_device(self) -> jax.Device:
        return self._replicas.local_devices[0]

    # Laying trees out.

    def layout_of(self, tree: PyTree, caller: str) -> PyTree:
        """The `NamedSharding` of each leaf of `tree` (an NNX object standing for its state)."""
        units, treedef = _units(_with_states(tree))
        return jax.tree.unflatten(treedef, [self._unit_sharding(path, unit, caller) for path, unit in units])

    def describe_layout(self, tree: PyTree, caller: str) -> LayoutDescription:
        """The table of `tree`'s layout; `PerReplica` leaves (values, not variables) left out."""
        units, _ = _units(_with_states(tree))
        rows = [
            self._leaf_layout(path, unit, caller) for path, unit in units if not isinstance(unit, PerReplica)
        ]
        unmatched = self.rules.unmatched_rules([path for path, _ in units])
        return LayoutDescription(tuple(rows), self.rules.devices_per_replica, tuple(unmatched))

    def shardings_for(
        self, tree: PyTree, *, caller: str, describe: Callable[[Any], str] | None = None
    ) -> PyTree:
        describe = describe or functools.partial(format_path, "tree")
        check_replica_count(tree, self.num_replicas, caller=caller, describe=describe)
        units, treedef = _units(tree)
        self.rules.warn_unmatched([path for path, _ in units], caller)
        return jax.tree.unflatten(treedef, [self._unit_sharding(path, unit, caller) for path, unit in units])

    def holds_variables_with(self, sharding: jax.sharding.Sharding, ndim: int) -> bool:
        return (
            isinstance(sharding, NamedSharding)
            and sharding.mesh == self.mesh
            and _split_only_within_spec(tuple(sharding.spec), stacked_first=False)
        )

    def run_input_shardings(self, caller: str) -> Shardings:
        return functools.partial(self._inputs_layout, caller=caller)

    @property
    def run_output_sharding(self) -> None:
        return None  # `replica_program` lays each output out.

    @property
    def run_layout_key(self) -> Callable[[PyTree], Hashable]:
        # Where an array already on the mesh is laid out, it stays (its sharding is its layout),
        # which a trace cannot see: jit itself refuses a committed array laid out otherwise, and
        # `run` then takes the slow path. What the trace must still check is which leaves are
        # PerReplicas, which the tree's structure says.
        return jax.tree.structure

    def replica_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
        return self._laying_out(self._replicas.replica_program(fn, owner, caller), caller=caller)

    def init_input_shardings(self, caller: str) -> Shardings:
        return functools.partial(self._inputs_layout, caller=caller)

    @property
    def init_output_sharding(self) -> None:
        return None  # `init_program` lays each output out.

    def init_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
        return self._laying_out(cross_replica_program(fn, owner), caller=caller)

    @property
    def in_flight_limit(self) -> InFlightLimit | None:
        return self._replicas.in_flight_limit

    @property
    def batch_layout(self) -> ReplicaLayout:
        return self._replicas.batch_layout

    def constrain(self, x: PyTree, spec: Any) -> PyTree:
        spec = self.rules.on_mesh(spec)
        context = jax.sharding.get_abstract_mesh()
        # Inside `run`'s shard_map the mesh in context is the strategy's, its replica axis
        # manual: a bare spec refers to it, where a sharding over the (all Auto) mesh would not
        # match it.
        in_replica = not context.empty and context.axis_names == self.mesh.axis_names
        target = spec if in_replica else NamedSharding(self.mesh, spec)
        return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, target), x)

    # Values across replicas.

    def reduce(self, op: ReduceOp, value: PyTree, axis: Any, caller: str) -> PyTree:
        return mesh_replicas.combine_leaves("reduce", op, value, axis, self._replicas, caller=caller)

    def gather(self, value: PyTree, axis: int, caller: str) -> PyTree:
        return mesh_replicas.combine_leaves("gather", None, value, axis, self._replicas, caller=caller)

    def local_results(self, value: PyTree, caller: str) -> tuple[PyTree, ...]:
        return mesh_replicas.local_results(value, self._replicas, self._local_copies, caller=caller)

    def distribute_values(
        self, value_fn: Callable[[ValueContext], PyTree], caller: str
    ) -> tuple[PyTree, ValuesToCompare | None]:
        return mesh_replicas.distribute_values(
            value_fn, self._replicas, self._assemble_components, caller=caller
        )

    # Helpers.

    def _local_copies(self, leaf: Any) -> tuple[Any, ...]:
        """Each local replica's value of `leaf`, on the replica's devices, laid out as there."""
        replicas = self._replicas
        if (
            isinstance(leaf, PerReplica)
            and isinstance(leaf.stacked, jax.Array)
            and not is_tracer(leaf.stacked)
        ):
            stacked = leaf.stacked
            if not replicas.holds(stacked) or not _split_only_within(stacked, stacked_first=True):
                stacked = jax.device_put(stacked, replicas.stacked)
            return tuple(
                self._part_on_replica(stacked, i, stacked_first=True) for i in replicas.local_replica_ids
            )
        if isinstance(leaf, jax.Array) and not is_tracer(leaf) and replicas.holds(leaf):
            if _split_only_within(leaf, stacked_first=False):
                return tuple(
                    self._part_on_replica(leaf, i, stacked_first=False) for i in replicas.local_replica_ids
                )
        return mesh_replicas.replicated_copies(leaf, replicas)

    def _assemble_components(self, parts: list[jax.Array]) -> jax.Array:
        # Each part, on the replica's first device here, copied to its other devices here (a
        # replica spanning processes gets the rest from the others); the stacked array is made
        # of those copies, without a trip through the host.
        pieces = []
        here = jax.process_index()
        for replica, part in zip(self._replicas.local_replica_ids, parts, strict=True):
            for device in self._replica_meshes[replica].devices.flat:
                if device.process_index == here:
                    pieces.append(jax.device_put(part, device)[None])
        shape = (self.num_replicas, *parts[0].shape)
        return jax.make_array_from_single_device_arrays(shape, self._replicas.stacked, pieces)

    def _leaf_layout(
        self, path: Sequence[Any], leaf: Any, caller: str, follows: tuple[PartitionSpec, str] | None = None
    ) -> LeafLayout:
        declared = None
        if nnx_objects.is_variable(leaf):
            declared = declared_spec(leaf, path_string(path), caller)
            leaf = leaf.get_raw_value()
        shape, dtype = _shape_and_dtype(leaf)
        return self.rules.leaf(path, shape, dtype, declared=declared, follows=follows, caller=caller)

    def _unit_sharding(self, path: Sequence[Any], unit: Any, caller: str) -> NamedSharding:
        """Where a leaf goes by the rules; a PerReplica's components whole on their replicas."""
        if isinstance(unit, PerReplica):
            return self._replicas.stacked
        return NamedSharding(self.mesh, self._leaf_layout(path, unit, caller).spec)

    def _inputs_layout(self, args_and_kwargs: PyTree, *, caller: str) -> PyTree:
        """Where `run` and `init` place their inputs: an array already on this mesh where it is,
        anything else by the rules (a PerReplica split over the replicas)."""
        check_replica_count(args_and_kwargs, self.num_replicas, caller=caller, describe=format_argument_path)
        units, treedef = _units(args_and_kwargs)
        shardings = []
        for path, unit in units:
            array = unit.stacked if isinstance(unit, PerReplica) else unit
            if isinstance(array, jax.Array) and not is_tracer(array) and self._replicas.holds(array):
                shardings.append(array.sharding)
            else:  # By the rules, the path past the argument.
                shardings.append(self._unit_sharding(path[2:], unit, caller))
        return jax.tree.unflatten(treedef, shardings)

    def _laying_out(self, program: StepFn, *, caller: str) -> StepFn:
        """`program`, its outputs constrained to their layouts (see `_lay_out_outputs`)."""

        def laid_out(*args: Any, **kwargs: Any) -> PyTree:
            return self._lay_out_outputs(program(*args, **kwargs), (args, kwargs), caller=caller)

        return laid_out

    def _lay_out_outputs(self, outputs: PyTree, inputs: PyTree, *, caller: str) -> PyTree:
        """`outputs` constrained to their layouts: each after the input it replaces, else by the
        rules; a PerReplica's components whole on their replicas."""
        followed = self._traced_inputs(inputs)
        units, treedef = _units(outputs)
        laid_out = []
        for path, unit in units:
            if isinstance(unit, PerReplica):
                stacked = jax.lax.with_sharding_constraint(unit.stacked, self._replicas.stacked)
                laid_out.append(PerReplica(stacked))
                continue
            shape = tuple(np.shape(unit))
            spec = self._leaf_layout(path, unit, caller, follows=follow_spec(path, shape, followed)).spec
            laid_out.append(jax.lax.with_sharding_constraint(unit, NamedSharding(self.mesh, spec)))
        return jax.tree.unflatten(treedef, laid_out)

    def _traced_inputs(self, inputs: PyTree) -> list[tuple[Sequence[Any], tuple[int, ...], PartitionSpec]]:
        """The whole-array inputs of the step being traced: path (past the argument), shape and
        the spec they were placed with."""
        announced = traced_input_layout()
        if announced is None:
            return []
        units, _ = _units(inputs)
        if isinstance(announced, jax.sharding.Sharding):
            shardings = [announced] * len(units)
        else:
            shardings = jax.tree.leaves(announced)
            if len(shardings) != len(units):
                return []
        found = []
        for (path, unit), sharding in zip(units, shardings, strict=True):
            if isinstance(unit, PerReplica) or not hasattr(unit, "shape"):
                continue
            if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
                found.append((path[2:], tuple(unit.shape), sharding.spec))
        return found

    def _part_on_replica(self, array: jax.Array, replica: int, *, stacked_first: bool) -> jax.Array:
        """Replica `replica`'s part of `array` (its component when `stacked_first`, else its
        copy), on that replica's devices, laid out as there. Of a replica spanning processes,
        a value this process holds whole comes back on this process's devices of it; one split
        between the processes, over all of them (this process holding its own blocks)."""
        mesh = self._replica_meshes[replica]
        spec = tuple(_spec(array))
        by_device = {shard.device: shard.data for shard in array.addressable_shards}
        if stacked_first:
            spec = spec[1:]
        local = [d for d in mesh.devices.flat if d in by_device]
        if len(local) < mesh.devices.size:
            mesh, spec = _held_here(mesh, spec, by_device)
            local = [d for d in mesh.devices.flat if d in by_device]
        blocks = [by_device[d] for d in local]
        if stacked_first:
            blocks = [block.reshape(block.shape[1:]) for block in blocks]
        shape = array.shape[1:] if stacked_first else array.shape
        return jax.make_array_from_single_device_arrays(
            shape, NamedSharding(mesh, PartitionSpec(*spec)), blocks
        )


def _held_here(
    mesh: jax.sharding.Mesh, spec: tuple[Any, ...], by_device: dict[jax.Device, Any]
) -> tuple[jax.sharding.Mesh, tuple[Any, ...]]:
    """Of a replica's `mesh` that spans processes, the part this process holds (`by_device`'s
    devices) where the value laid out by `spec` is whole there; else `mesh` and `spec`.

    This process's devices of a replica are whole rows of its mesh (a process's devices are
    consecutive, and every replica is made of whole processes); the value is whole on them when
    every axis `spec` names is within the rows, all of it held here.
    """
    grid = mesh.devices
    rows = [row for row in range(grid.shape[0]) if all(d in by_device for d in grid[row : row + 1].flat)]
    named = {n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None}
    if rows and not (mesh.axis_names[0] in named and len(rows) < grid.shape[0]):
        return jax.sharding.Mesh(grid[rows], mesh.axis_names, axis_types=mesh.axis_types), spec
    if named:  # Split between the processes.
        return mesh, spec
    # Whole, over a 'model' axis wider than a process's devices: on those.
    local = [d for d in grid.flat if d in by_device]
    return jax.sharding.Mesh(np.array(local), (SHARD_AXIS,)), ()


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _without_trailing_nones(spec: PartitionSpec) -> tuple[Any, ...]:
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


def _split_only_within(array: jax.Array, *, stacked_first: bool) -> bool:
    """Whether `array` (on a sharded strategy's mesh) is split over `'replica'` only along its
    first axis when `stacked_first`, and not at all otherwise."""
    return _split_only_within_spec(tuple(_spec(array)), stacked_first=stacked_first)


def _spec(array: jax.Array) -> PartitionSpec:
    """The spec of an array on a mesh (`_on_mesh` said so: its sharding is a NamedSharding)."""
    sharding = array.sharding
    assert isinstance(sharding, NamedSharding)
    return sharding.spec


def _split_only_within_spec(spec: tuple[Any, ...], *, stacked_first: bool) -> bool:
    names = [
        [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None] for entry in spec
    ]
    if stacked_first:
        return bool(names) and names[0] == [REPLICA_AXIS] and all(REPLICA_AXIS not in n for n in names[1:])
    return all(REPLICA_AXIS not in n for n in names)


def _units(tree: PyTree) -> tuple[list[tuple[Any, Any]], Any]:
    """`tree`'s leaves with their paths, a PerReplica or an NNX Variable counting as one."""
    return jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, PerReplica) or nnx_objects.is_variable(x)
    )


def _with_states(tree: PyTree) -> PyTree:
    found = nnx_objects.find_objects(tree)
    return tree if found is None else nnx_objects.with_states(found)


def _shape_and_dtype(leaf: Any) -> tuple[tuple[int, ...], Any]:
    """The shape and the dtype JAX stores `leaf` as (float32 for a float64 numpy array, with
    64-bit types off): what a device holds."""
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        shape, dtype = tuple(leaf.shape), leaf.dtype
    else:
        shape, dtype = tuple(np.shape(leaf)), np.asarray(leaf).dtype
    if jnp.issubdtype(dtype, jax.dtypes.extended):
        return shape, dtype  # PRNG keys: JAX's own.
    return shape, jax.dtypes.canonicalize_dtype(dtype)
