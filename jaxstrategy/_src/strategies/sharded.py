"""`ShardedStrategy`: per-replica code over models split across each replica's devices.

The devices form a mesh `('replica', 'shard')` of R x S, both axes left to the compiler (Auto).
Each replica is a row of S consecutive devices and holds the whole model, each large leaf split
over its S devices (`values/layouts.py` decides how). `run` is `MeshStrategy`'s program with only
the replica axis manual: inside `fn` every variable has its full shape and XLA gathers and
reduces over `'shard'`, while `all_reduce`, `all_gather` and `replica_id_in_sync_group` act over
the replicas, as on `MirroredStrategy`. This is TensorFlow's `TPUStrategy` with SPMD partitioning,
on any backend; TensorFlow's DTensor-backed `MirroredStrategy` instead ran `fn` once, globally, and
had no replica context.

Layouts stay put: `put`, `init` and `run` place every leaf by the same rules, and an output of
`run` or `init` that ends with an input's path and has its shape is laid out as that input, so a
step returns its parameters and optimizer state where they were, and compiles once.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxstrategy._src.core.device_spec import spans_processes
from jaxstrategy._src.core.errors import format_argument_path, format_path
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import DeviceLike, PyTree, StepFn
from jaxstrategy._src.steps import nnx_objects
from jaxstrategy._src.steps.cache import traced_input_layout
from jaxstrategy._src.steps.spmd import REPLICA_AXIS
from jaxstrategy._src.strategies.mesh import MeshStrategy
from jaxstrategy._src.strategies.mirrored import resolve_devices
from jaxstrategy._src.strategies.strategy import get_strategy
from jaxstrategy._src.values.layouts import (
    DEFAULT_MIN_SHARD_BYTES,
    MODEL_AXIS,
    SHARD_AXIS,
    LayoutDescription,
    LayoutRules,
    LeafLayout,
    as_spec,
    declared_spec,
    follow_spec,
    path_string,
)
from jaxstrategy._src.values.per_replica import PerReplica, check_replica_count


class ShardedStrategy(MeshStrategy):
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
        resolved = resolve_devices(devices, caller="ShardedStrategy")
        if spans_processes(resolved):
            raise ValueError(
                f"{caller}: the devices span several processes; a ShardedStrategy holds one "
                "process's devices. Use MultiWorkerShardedStrategy for a job of several processes, "
                "or pass this process's devices (jax.local_devices())."
            )
        self._lay_out(
            resolved, num_replicas, model_parallel, layout, min_shard_bytes, caller, devices_given=True
        )

    def _lay_out(
        self,
        devices: tuple[jax.Device, ...],
        num_replicas: int,
        model_parallel: int,
        layout: Sequence[tuple[str, Any]] | None,
        min_shard_bytes: int,
        caller: str,
        *,
        devices_given: bool = False,
    ) -> None:
        """Make the mesh: `devices`, in replica order, as `num_replicas` rows of S x M
        (`devices_given`: the user chose them, and may choose others)."""
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
        self._rules = LayoutRules(
            layout, shards=shards, model=model_parallel, min_shard_bytes=min_shard_bytes, caller=caller
        )
        axes = (REPLICA_AXIS, SHARD_AXIS, MODEL_AXIS) if model_parallel > 1 else (REPLICA_AXIS, SHARD_AXIS)
        grid = np.array(devices, dtype=object).reshape(num_replicas, shards, model_parallel)
        if model_parallel == 1:
            grid = grid[..., 0]
        auto = (jax.sharding.AxisType.Auto,) * len(axes)
        super().__init__(devices, jax.sharding.Mesh(grid, axes, axis_types=auto))
        self._replica_meshes = tuple(jax.sharding.Mesh(row, axes[1:], axis_types=auto[1:]) for row in grid)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(devices={self._devices!r}, num_replicas={self._num_replicas}, "
            f"model_parallel={self._rules.model}, layout={list(self._rules.rules)!r}, "
            f"min_shard_bytes={self._rules.min_shard_bytes})"
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)

    @property
    def _key(self) -> Hashable:
        # P(None) is P(): specs compare without their trailing Nones.
        rules = tuple((source, _without_trailing_nones(spec)) for source, spec in self._rules.rules)
        return (self._devices, self._num_replicas, self._rules.model, rules, self._rules.min_shard_bytes)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device, replica by replica: replica i holds `devices[i*D:(i+1)*D]`, where D is
        `devices_per_replica` (S x M)."""
        return self._devices

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
        return self._mesh

    @property
    def sharding(self) -> NamedSharding:
        """`NamedSharding(mesh, P())`: replicated on every device. Variables are laid out leaf by
        leaf instead: see `layout_of`."""
        return self._sharding

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
        tree = _with_states(tree)
        units, treedef = _units(tree)
        leaves = [self._unit_sharding(path, unit, "ShardedStrategy.layout_of()") for path, unit in units]
        return jax.tree.unflatten(treedef, leaves)

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
        caller = "ShardedStrategy.describe_layout()"
        tree = _with_states(tree)
        units, _ = _units(tree)
        rows = []
        for path, unit in units:
            if isinstance(unit, PerReplica):
                continue
            rows.append(self._leaf_layout(path, unit, caller))
        unmatched = self._rules.unmatched_rules([path for path, _ in units])
        return LayoutDescription(tuple(rows), self.devices_per_replica, tuple(unmatched))

    # Hooks of Strategy and MeshStrategy.

    @property
    def _run_input_shardings(self) -> Callable[[PyTree], PyTree]:
        return functools.partial(self._inputs_layout, caller="ShardedStrategy.run()")

    @property
    def _run_layout_key(self) -> Callable[[PyTree], Hashable]:
        # Where an array already on the mesh is laid out, it stays (its sharding is its layout),
        # which a trace cannot see: jit itself refuses a committed array laid out otherwise, and
        # `run` then takes the slow path. What the trace must still check is which leaves are
        # PerReplicas, which the tree's structure says.
        return jax.tree.structure

    @property
    def _init_input_shardings(self) -> Callable[[PyTree], PyTree]:
        return functools.partial(self._inputs_layout, caller="ShardedStrategy.init()")

    @property
    def _init_output_sharding(self) -> None:
        return None  # `_init_program` lays each output out.

    def _replica_program(self, fn: StepFn) -> StepFn:
        return self._laying_out(super()._replica_program(fn), caller="ShardedStrategy.run()")

    def _init_program(self, fn: StepFn) -> StepFn:
        return self._laying_out(self._cross_replica_program(fn), caller="ShardedStrategy.init()")

    def _shardings_for(
        self, tree: PyTree, *, caller: str, describe: Callable[[Any], str] | None = None
    ) -> PyTree:
        describe = describe or functools.partial(format_path, "tree")
        check_replica_count(tree, self._num_replicas, caller=caller, describe=describe)
        units, treedef = _units(tree)
        self._rules.warn_unmatched([path for path, _ in units], caller)
        return jax.tree.unflatten(treedef, [self._unit_sharding(path, unit, caller) for path, unit in units])

    def _local_copies(self, leaf: Any) -> tuple[Any, ...]:
        if (
            isinstance(leaf, PerReplica)
            and isinstance(leaf.stacked, jax.Array)
            and not is_tracer(leaf.stacked)
        ):
            stacked = leaf.stacked
            if not self._on_mesh(stacked) or not _split_only_within(stacked, stacked_first=True):
                stacked = jax.device_put(stacked, self._stacked_sharding)
            return tuple(
                self._part_on_replica(stacked, i, stacked_first=True) for i in self._local_replica_ids
            )
        if isinstance(leaf, jax.Array) and not is_tracer(leaf) and self._on_mesh(leaf):
            if _split_only_within(leaf, stacked_first=False):
                return tuple(
                    self._part_on_replica(leaf, i, stacked_first=False) for i in self._local_replica_ids
                )
        return super()._local_copies(leaf)

    def _assemble_components(self, parts: list[jax.Array]) -> jax.Array:
        # Each part, on the replica's first device here, copied to its other devices here (a
        # replica spanning processes gets the rest from the others); the stacked array is made
        # of those copies, without a trip through the host.
        pieces = []
        here = jax.process_index()
        for replica, part in zip(self._local_replica_ids, parts, strict=True):
            for device in self._replica_meshes[replica].devices.flat:
                if device.process_index == here:
                    pieces.append(jax.device_put(part, device)[None])
        shape = (self._num_replicas, *parts[0].shape)
        return jax.make_array_from_single_device_arrays(shape, self._stacked_sharding, pieces)

    def _holds_variables_with(self, sharding: jax.sharding.Sharding, ndim: int) -> bool:
        return (
            isinstance(sharding, NamedSharding)
            and sharding.mesh == self._mesh
            and _split_only_within_spec(tuple(sharding.spec), stacked_first=False)
        )

    # Helpers.

    def _leaf_layout(
        self, path: Sequence[Any], leaf: Any, caller: str, follows: tuple[PartitionSpec, str] | None = None
    ) -> LeafLayout:
        declared = None
        if nnx_objects.is_variable(leaf):
            declared = declared_spec(leaf, path_string(path), caller)
            leaf = leaf.get_raw_value()
        shape, dtype = _shape_and_dtype(leaf)
        return self._rules.leaf(path, shape, dtype, declared=declared, follows=follows, caller=caller)

    def _unit_sharding(self, path: Sequence[Any], unit: Any, caller: str) -> NamedSharding:
        """Where a leaf goes by the rules; a PerReplica's components whole on their replicas."""
        if isinstance(unit, PerReplica):
            return self._stacked_sharding
        return NamedSharding(self._mesh, self._leaf_layout(path, unit, caller).spec)

    def _inputs_layout(self, args_and_kwargs: PyTree, *, caller: str) -> PyTree:
        """Where `run` and `init` place their inputs: an array already on this mesh where it is,
        anything else by the rules (a PerReplica split over the replicas)."""
        check_replica_count(args_and_kwargs, self._num_replicas, caller=caller, describe=format_argument_path)
        units, treedef = _units(args_and_kwargs)
        shardings = []
        for path, unit in units:
            array = unit.stacked if isinstance(unit, PerReplica) else unit
            if isinstance(array, jax.Array) and not is_tracer(array) and self._on_mesh(array):
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
                stacked = jax.lax.with_sharding_constraint(unit.stacked, self._stacked_sharding)
                laid_out.append(PerReplica(stacked))
                continue
            shape = tuple(np.shape(unit))
            spec = self._leaf_layout(path, unit, caller, follows=follow_spec(path, shape, followed)).spec
            laid_out.append(jax.lax.with_sharding_constraint(unit, NamedSharding(self._mesh, spec)))
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
            if isinstance(sharding, NamedSharding) and sharding.mesh == self._mesh:
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
    caller = "jaxstrategy.with_sharding_constraint()"
    spec = as_spec(spec, where="the activation", caller=caller)
    strategy = get_strategy()
    if not isinstance(strategy, ShardedStrategy):
        return x
    spec = strategy._rules.on_mesh(spec)
    context = jax.sharding.get_abstract_mesh()
    # Inside `run`'s shard_map the mesh in context is the strategy's, its replica axis manual: a
    # bare spec refers to it, where a sharding over the (all Auto) mesh would not match it.
    in_replica = not context.empty and context.axis_names == strategy.mesh.axis_names
    target = spec if in_replica else NamedSharding(strategy.mesh, spec)
    return jax.tree.map(lambda leaf: jax.lax.with_sharding_constraint(leaf, target), x)
