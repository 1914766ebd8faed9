"""`ReplicatedPlacement`: one replica per device of a one-axis mesh, variables on every device.

The placement of `MirroredStrategy` (this process's devices) and `MultiWorkerMirroredStrategy`
(every process's). Variables are replicated, `NamedSharding(mesh, P())`; `run` is one `jax.jit`
of a `jax.shard_map` over the `'replica'` axis; values that differ between replicas are
`PerReplica`s (`mesh_replicas.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxstrategy._src.core.errors import format_argument_path
from jaxstrategy._src.core.types import PyTree, StepFn, StrategyLike
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps.in_flight import InFlightLimit
from jaxstrategy._src.steps.spmd import REPLICA_AXIS
from jaxstrategy._src.strategies import mesh_replicas
from jaxstrategy._src.strategies.mesh_replicas import MeshReplicas
from jaxstrategy._src.strategies.placement import Placement, Shardings, ValuesToCompare
from jaxstrategy._src.values.contexts import ValueContext
from jaxstrategy._src.values.reduce_op import ReduceOp


class ReplicatedPlacement(Placement):
    """One replica per device of `devices` (in replica order), on the mesh `('replica',)`.

    The mesh may span several processes; each then holds its own replicas' components.
    `caller` is the constructor to name in messages, such as `MirroredStrategy()`.
    """

    def __init__(self, devices: tuple[jax.Device, ...], *, caller: str):
        mesh = jax.sharding.Mesh(np.array(devices), (REPLICA_AXIS,))
        self._replicas = MeshReplicas(devices, mesh, caller=caller)
        self._local_copies = functools.partial(mesh_replicas.replicated_copies, replicas=self._replicas)
        self._assemble = functools.partial(mesh_replicas.assemble_on_first_devices, replicas=self._replicas)

    @property
    def key(self) -> Hashable:
        return self._replicas.devices

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

    def shardings_for(
        self, tree: PyTree, *, caller: str, describe: Callable[[Any], str] | None = None
    ) -> jax.sharding.Sharding | PyTree:
        return mesh_replicas.shardings_with_components(tree, self._replicas, caller=caller, describe=describe)

    def holds_variables_with(self, sharding: jax.sharding.Sharding, ndim: int) -> bool:
        return sharding.is_equivalent_to(self._replicas.replicated, ndim)

    def run_input_shardings(self, caller: str) -> Shardings:
        return functools.partial(
            mesh_replicas.shardings_with_components,
            replicas=self._replicas,
            caller=caller,
            describe=format_argument_path,
        )

    @property
    def run_output_sharding(self) -> None:
        return None  # The shard_map decides each leaf's sharding.

    def replica_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
        return self._replicas.replica_program(fn, owner, caller)

    @property
    def in_flight_limit(self) -> InFlightLimit | None:
        return self._replicas.in_flight_limit

    @property
    def batch_layout(self) -> ReplicaLayout:
        return self._replicas.batch_layout

    def reduce(self, op: ReduceOp, value: PyTree, axis: Any, caller: str) -> PyTree:
        return mesh_replicas.combine_leaves("reduce", op, value, axis, self._replicas, caller=caller)

    def gather(self, value: PyTree, axis: int, caller: str) -> PyTree:
        return mesh_replicas.combine_leaves("gather", None, value, axis, self._replicas, caller=caller)

    def local_results(self, value: PyTree, caller: str) -> tuple[PyTree, ...]:
        return mesh_replicas.local_results(value, self._replicas, self._local_copies, caller=caller)

    def distribute_values(
        self, value_fn: Callable[[ValueContext], PyTree], caller: str
    ) -> tuple[PyTree, ValuesToCompare | None]:
        return mesh_replicas.distribute_values(value_fn, self._replicas, self._assemble, caller=caller)
