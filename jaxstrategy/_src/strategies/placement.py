"""`Placement`: the part of a strategy that decides where values live and what a replica runs.

A strategy is a placement and a job (`job.py`). The placement knows the devices, the mesh and
how a tree is laid out over them; `Strategy`'s TensorFlow-shaped methods check their arguments
and hand the work to it. A new kind of strategy is a new placement: one class implementing
this interface, as `OneDevicePlacement`, `ReplicatedPlacement` and `ShardedPlacement` do.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import jax

from jaxstrategy._src.core.types import PyTree, StepFn, StrategyLike
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps.in_flight import InFlightLimit
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.contexts import ValueContext
from jaxstrategy._src.values.reduce_op import ReduceOp

# What places a tree: one sharding for every leaf, or a function of the tree returning one
# sharding or a tree of them shaped like it (see `StepCache`).
Shardings = jax.sharding.Sharding | Callable[[PyTree], PyTree]


class Placement(abc.ABC):
    """Where a strategy's values live, how a tree is laid out, and what a replica runs.

    Every method that raises takes `caller`, the public call as the user wrote it
    (`MirroredStrategy.reduce()`), to name in its messages. Methods that build programs take
    `owner`, the strategy whose replica context the program enters.
    """

    # Identity: two strategies of one class are equal when their placements' keys are.

    @property
    @abc.abstractmethod
    def key(self) -> Hashable:
        """What makes two placements of one class the same."""

    # Facts.

    @property
    @abc.abstractmethod
    def devices(self) -> tuple[jax.Device, ...]:
        """Every device, in replica order."""

    @property
    @abc.abstractmethod
    def mesh(self) -> jax.sharding.Mesh:
        """The mesh of the devices; its first axis is `'replica'`."""

    @property
    @abc.abstractmethod
    def sharding(self) -> jax.sharding.Sharding:
        """Where a value held whole by every replica lives."""

    @property
    @abc.abstractmethod
    def num_replicas(self) -> int:
        """How many replicas run the step."""

    @abc.abstractmethod
    def default_device(self) -> jax.Device:
        """The device JAX creates arrays on inside `scope()`."""

    # Laying trees out: `put`, `init`, `run`.

    @abc.abstractmethod
    def shardings_for(
        self, tree: PyTree, *, caller: str, describe: Callable[[Any], str] | None = None
    ) -> jax.sharding.Sharding | PyTree:
        """Where `put` places the leaves of `tree`: one sharding for all, or a tree of them
        shaped like `tree`. `describe` turns a leaf's key path into its name in messages."""

    @abc.abstractmethod
    def holds_variables_with(self, sharding: jax.sharding.Sharding, ndim: int) -> bool:
        """Whether an array of `ndim` dimensions laid out by `sharding` is placed as `put` places
        variables."""

    @abc.abstractmethod
    def run_input_shardings(self, caller: str) -> Shardings:
        """Where `run` places its `(args, kwargs)`."""

    @property
    @abc.abstractmethod
    def run_output_sharding(self) -> jax.sharding.Sharding | None:
        """Where `run` commits its outputs; None when `replica_program` lays them out."""

    @property
    def run_layout_key(self) -> Callable[[PyTree], Hashable] | None:
        """What a step compiled for one input layout checks of another call's `(args, kwargs)`,
        where `run_input_shardings` depends on where arrays are; None: the layout itself."""
        return None

    @abc.abstractmethod
    def replica_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
        """What `run` compiles: `fn` on every replica, in its replica context."""

    def init_input_shardings(self, caller: str) -> Shardings:
        """Where `init` places its inputs."""
        return self.sharding

    @property
    def init_output_sharding(self) -> jax.sharding.Sharding | None:
        """Where `init` commits its outputs; None when `init_program` lays them out."""
        return self.sharding

    def init_program(self, fn: StepFn, owner: StrategyLike, caller: str) -> StepFn:
        """What `init` compiles: `fn` in the cross-replica context."""
        return cross_replica_program(fn, owner)

    @property
    def in_flight_limit(self) -> InFlightLimit | None:
        """What bounds the `run` steps queued at once (None: nothing); see `InFlightLimit`."""
        return None

    @property
    @abc.abstractmethod
    def batch_layout(self) -> ReplicaLayout:
        """How distributed datasets lay batches out over the replicas."""

    def constrain(self, x: PyTree, spec: Any) -> PyTree:
        """`jaxstrategy.with_sharding_constraint(x, spec)` on this placement: `x` itself where
        the placement has no axes within a replica."""
        del spec
        return x

    # Values across replicas.

    @abc.abstractmethod
    def reduce(self, op: ReduceOp, value: PyTree, axis: Any, caller: str) -> PyTree:
        """Reduce checked arguments across replicas (and along `axis` when not None)."""

    @abc.abstractmethod
    def gather(self, value: PyTree, axis: int, caller: str) -> PyTree:
        """Concatenate the replicas' values of `value` along `axis`."""

    @abc.abstractmethod
    def local_results(self, value: PyTree, caller: str) -> tuple[PyTree, ...]:
        """The values of `value` on this process's replicas."""

    @abc.abstractmethod
    def distribute_values(
        self, value_fn: Callable[[ValueContext], PyTree], caller: str
    ) -> tuple[PyTree, ValuesToCompare | None]:
        """Call `value_fn` for this process's replicas and distribute the results; with what the
        processes of a job must compare of them (None where the devices are one process's)."""


@dataclasses.dataclass(frozen=True)
class ValuesToCompare:
    """What the processes of a job compare of `experimental_distribute_values_from_function`'s
    results: their structure, shapes and dtypes (`signature`), and the content of each replica
    that several processes give a component of (`shared`, replica id -> digest)."""

    signature: str
    shared: dict[str, str]


def cross_replica_program(fn: StepFn, owner: StrategyLike) -> StepFn:
    """`fn`, run in `owner`'s cross-replica context (what `init` compiles)."""

    def in_cross_replica_context(*args: Any, **kwargs: Any) -> PyTree:
        with contexts.entered(owner):
            return fn(*args, **kwargs)

    return in_cross_replica_context
