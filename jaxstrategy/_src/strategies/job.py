"""The part of a strategy that decides who takes part: this process alone, or a job of several.

`OneProcess` asks nothing of anyone. `JobOfProcesses` is a job joined through
`jax.distributed` (`cluster/joining.py`): its resolver and TensorFlow's facts about it, the
watch over the other processes' ends, the check that every process runs the same programs,
each process's input pipeline, and the processes' agreement on distributed values.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from jaxstrategy._src.cluster import job_exits
from jaxstrategy._src.cluster.coordination import require_same_on_every_process
from jaxstrategy._src.cluster.joining import JoinSettings, join_cluster
from jaxstrategy._src.cluster.program_agreement import ProgramAgreement
from jaxstrategy._src.cluster.resolver import ClusterResolver
from jaxstrategy._src.core.arguments import check_int
from jaxstrategy._src.core.device_spec import canonical_name, spans_processes
from jaxstrategy._src.core.errors import format_call
from jaxstrategy._src.core.types import PyTree, StepFn
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.strategies.placement import Placement, ValuesToCompare
from jaxstrategy._src.strategies.run_path import RunPath, RunsSteps
from jaxstrategy._src.values.options import RunOptions


@dataclasses.dataclass(frozen=True)
class StrategyExtended:
    """`strategy.extended`: TensorFlow's read-only facts about a strategy's devices and roles.

    Attributes:
      worker_devices: the compute devices, as TensorFlow's canonical names.
      parameter_devices: where variables live, as TensorFlow's canonical names.
      experimental_between_graph: always False (one program drives every device).
      experimental_should_init: whether this process initialises variables.
      should_checkpoint: whether this process should save checkpoints.
      should_save_summary: whether this process should write summaries.
      experimental_require_static_shapes: False; JAX compiles one program per shape.

    Example:
      >>> import jaxstrategy
      >>> extended = jaxstrategy.OneDeviceStrategy('/cpu:0').extended
      >>> extended.worker_devices, extended.should_checkpoint
      (('/job:localhost/replica:0/task:0/device:CPU:0',), True)
    """

    worker_devices: tuple[str, ...]
    parameter_devices: tuple[str, ...]
    experimental_between_graph: bool = False
    experimental_should_init: bool = True
    should_checkpoint: bool = True
    should_save_summary: bool = True
    experimental_require_static_shapes: bool = False


class OneProcess:
    """This process alone: no resolver, one input pipeline, nothing to agree on."""

    cluster_resolver = None
    input_pipeline = (1, 0)  # (num_input_pipelines, input_pipeline_id)

    def take_part(self, placement: Placement, name: str) -> None:
        """Nothing to watch."""
        del placement, name

    def extended(self, placement: Placement) -> StrategyExtended:
        names = tuple(canonical_name(device) for device in placement.devices)
        return StrategyExtended(worker_devices=names, parameter_devices=names)

    def batch_layout(self, layout: ReplicaLayout) -> ReplicaLayout:
        return layout

    def traced_program(self, fn: StepFn, program: StepFn) -> StepFn:
        del fn
        return program

    def run_path(self, path: RunPath) -> RunsSteps:
        return path

    def before_checked_run(self, caller: str) -> None:
        """Nothing to check before `run`'s checked path."""
        del caller

    def compare_values(self, values: ValuesToCompare | None, caller: str) -> None:
        del values, caller


ONE_PROCESS = OneProcess()


class JobOfProcesses:
    """A job joined through `jax.distributed`: made by `join`, before any other JAX call, then
    given the strategy's placement by `take_part` once the devices are known."""

    def __init__(
        self,
        cluster_resolver: ClusterResolver,
        *,
        heartbeat_timeout_s: int,
        input_timeout_s: int,
    ):
        self.cluster_resolver = cluster_resolver
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._input_timeout_s = float(input_timeout_s)
        self.input_pipeline = (1, 0)
        self._programs: ProgramAgreement | None = None

    @classmethod
    def join(
        cls,
        cluster_resolver: ClusterResolver | None,
        *,
        initialization_timeout: int,
        heartbeat_timeout_seconds: int,
        input_timeout_seconds: int,
        caller: str,
    ) -> JobOfProcesses:
        """Check the timeouts and join the job (see `join_cluster`). `caller` is the strategy's
        constructor, such as `MultiWorkerMirroredStrategy()`."""
        for argument, value in (
            ("initialization_timeout", initialization_timeout),
            ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
            ("input_timeout_seconds", input_timeout_seconds),
        ):
            label = format_call(caller, f"{argument}={value!r}")
            check_int(value, label, not_int=TypeError, expected="an int of seconds")
            check_int(value, label, at_least=1, expected="1 second or more")
        resolver = join_cluster(
            cluster_resolver, JoinSettings(initialization_timeout, heartbeat_timeout_seconds, caller)
        )
        return cls(
            resolver,
            heartbeat_timeout_s=heartbeat_timeout_seconds,
            input_timeout_s=input_timeout_seconds,
        )

    @property
    def program_agreement(self) -> ProgramAgreement | None:
        """The check that every process runs the same programs; None in a job of one process."""
        return self._programs

    def take_part(self, placement: Placement, name: str) -> None:
        """Where the job has several processes: watch their ends, and check their programs."""
        self.input_pipeline = input_pipeline_of_this_process(placement.devices, placement.num_replicas)
        if spans_processes(placement.devices):
            job_exits.watch_job(jax.process_index(), jax.process_count(), self._heartbeat_timeout_s)
            self._programs = ProgramAgreement(caller=f"{name}.run()")

    def extended(self, placement: Placement) -> StrategyExtended:
        """This process's devices, named in its job and task as TensorFlow names them; only the
        chief (process 0, never an evaluator) writes what one process writes."""
        resolver = self.cluster_resolver
        job = resolver.task_type or "localhost"
        task = resolver.task_id if resolver.task_id is not None else resolver.process_id
        here = jax.process_index()
        names = tuple(
            canonical_name(d, job=job, task=task) for d in placement.devices if d.process_index == here
        )
        is_chief = resolver.process_id == 0 and resolver.task_type != "evaluator"
        return StrategyExtended(
            worker_devices=names,
            parameter_devices=names,
            experimental_between_graph=resolver.num_processes > 1,
            should_checkpoint=is_chief,
            should_save_summary=is_chief,
        )

    def batch_layout(self, layout: ReplicaLayout) -> ReplicaLayout:
        return dataclasses.replace(layout, input_timeout_s=self._input_timeout_s)

    def traced_program(self, fn: StepFn, program: StepFn) -> StepFn:
        """The program check's hook where a step is traced: its jaxpr names the program."""
        return program if self._programs is None else self._programs.fingerprinting(fn, program)

    def run_path(self, path: RunPath) -> RunsSteps:
        """`path`, recording each call's function for the program check where there is one."""
        return path if self._programs is None else _RecordedRunPath(path, self._programs)

    def before_checked_run(self, caller: str) -> None:
        # Compiling and first steps take the checked path: a process that ended would leave
        # them waiting.
        job_exits.raise_if_a_process_ended(caller)

    def compare_values(self, values: ValuesToCompare | None, caller: str) -> None:
        """Raise on every process unless all gave the same structure, shapes and dtypes, and the
        same values to the replicas they share."""
        if values is None:
            return
        require_same_on_every_process(
            values.signature,
            what="value_fn's results",
            caller=caller,
            timeout_s=self._input_timeout_s,
            shared=values.shared,
        )


class _RecordedRunPath:
    """`RunPath.run`, after recording the function for the program check (see
    cluster/program_agreement.py): a list append, and a round with the other processes every
    `CALLS_PER_ROUND` calls, handed to a thread. Its error, raised before the step, names both
    programs."""

    __slots__ = ("_path", "_programs")

    def __init__(self, path: RunPath, programs: ProgramAgreement):
        self._path = path
        self._programs = programs

    def run(
        self,
        fn: StepFn,
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> PyTree:
        self._programs.record(fn)
        return self._path.run(fn, args, kwargs, options)


# Who takes part in a strategy's work.
Job = OneProcess | JobOfProcesses


def input_pipeline_of_this_process(devices: Sequence[Any], num_replicas: int) -> tuple[int, int]:
    """`(num_input_pipelines, input_pipeline_id)` for this process of the job over `devices` (in
    replica order): one pipeline per set of replicas that processes hold, so that processes that
    share a replica (parts of one replica of a `MultiWorkerShardedStrategy` spanning them) read
    the same input for it, and every other process its own.
    """
    per_replica = len(devices) // num_replicas
    held: dict[int, set[int]] = collections.defaultdict(set)
    for position, device in enumerate(devices):
        held[device.process_index].add(position // per_replica)
    groups = sorted({tuple(sorted(replicas)) for replicas in held.values()})
    return len(groups), groups.index(tuple(sorted(held[jax.process_index()])))
