"""`MultiWorkerMirroredStrategy`: MirroredStrategy's one program over the devices of many processes.

Every process runs the same script. Creating the strategy works out the job from a cluster
resolver and starts JAX's distributed runtime (`jax.distributed.initialize`) once per process;
from then on the mesh spans every device of every process, and everything works as on
`MirroredStrategy` (see `mesh.MeshStrategy`), with XLA's collectives (gloo on CPU, NCCL on
GPU) doing the communication. jaxstrategy opens no connection of its own.

Starting the runtime can fail in ways JAX reports by ending the process from C++ (a coordinator
that cannot be reached, a process that never starts), so the start-up is watched: when it takes
longer than its timeout, a message saying what to check goes to stderr before JAX ends the
process.

Starting it also installs a SIGTERM handler of JAX's own (its preemption notifier), which only
logs the signal, so that a job its scheduler told to stop kept running. The handler Python had
is put back once the runtime runs (`_put_back_sigterm`): SIGTERM ends the process, as it does
without `jax.distributed`, unless the program handles it (`checkpoint.PreemptionHandler`).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import jax

from jaxstrategy._src.cluster import job_exits
from jaxstrategy._src.cluster.program_agreement import ProgramAgreement
from jaxstrategy._src.cluster.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    ThisProcessResolver,
    check_job,
)
from jaxstrategy._src.core import jax_compat
from jaxstrategy._src.core.arguments import check_int
from jaxstrategy._src.core.device_spec import canonical_name, spans_processes
from jaxstrategy._src.core.errors import InvalidDeviceError, bullet_list, caller_stacklevel
from jaxstrategy._src.core.types import PyTree, StepFn
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.strategies.mesh import MeshStrategy
from jaxstrategy._src.strategies.strategy import StrategyExtended
from jaxstrategy._src.values.options import RunOptions

_CALLER = "MultiWorkerMirroredStrategy()"


class JobMember(MeshStrategy):
    """What the strategies of a job of several processes share: joining the job, its resolver and
    TensorFlow's facts about it, the check that every process runs the same programs, the watch
    over the other processes' ends, and each process's input pipeline.

    A subclass's constructor calls `_join` first, before any other JAX call, then makes its mesh
    (`MeshStrategy.__init__`), then calls `_watch_job`.
    """

    def _join(
        self,
        cluster_resolver: ClusterResolver | None,
        initialization_timeout: int,
        heartbeat_timeout_seconds: int,
        input_timeout_seconds: int,
    ) -> None:
        """Check the timeouts and join the job (see `join_cluster`)."""
        name = type(self).__name__
        for argument, value in (
            ("initialization_timeout", initialization_timeout),
            ("heartbeat_timeout_seconds", heartbeat_timeout_seconds),
            ("input_timeout_seconds", input_timeout_seconds),
        ):
            label = f"{name}({argument}={value!r})"
            check_int(value, label, not_int=TypeError, expected="an int of seconds")
            check_int(value, label, at_least=1, expected="1 second or more")
        self._input_timeout_s = float(input_timeout_seconds)
        self._heartbeat_timeout_s = heartbeat_timeout_seconds
        self._cluster_resolver = join_cluster(
            cluster_resolver,
            _Timeouts(initialization_timeout, heartbeat_timeout_seconds, caller=f"{name}()"),
        )

    def _watch_job(self) -> None:
        """Where the job has several processes: watch their ends, and check their programs."""
        self._pipeline = _input_pipeline_of_this_process(self._devices, self._num_replicas)
        self._programs: ProgramAgreement | None = None
        if spans_processes(self._devices):
            job_exits.watch_job(jax.process_index(), jax.process_count(), self._heartbeat_timeout_s)
            self._programs = ProgramAgreement(caller=f"{type(self).__name__}.run()")

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver of the job this process belongs to (`task_type`, `task_id`, ...)."""
        return self._cluster_resolver

    @property
    def extended(self) -> StrategyExtended:
        """TensorFlow's facts: this process's devices, and whether it is the chief.

        `worker_devices` are this process's devices, named in its job and task as TensorFlow
        names them. Only the chief (process 0, never an evaluator) should write what one process
        writes (logs, summaries); with several processes, each runs its own copy of the program
        (`experimental_between_graph`). Every process must still call `checkpoint.save`.
        """
        resolver = self._cluster_resolver
        job = resolver.task_type or "localhost"
        task = resolver.task_id if resolver.task_id is not None else resolver.process_id
        here = jax.process_index()
        names = tuple(canonical_name(d, job=job, task=task) for d in self._devices if d.process_index == here)
        is_chief = resolver.process_id == 0 and resolver.task_type != "evaluator"
        return StrategyExtended(
            worker_devices=names,
            parameter_devices=names,
            experimental_between_graph=resolver.num_processes > 1,
            should_checkpoint=is_chief,
            should_save_summary=is_chief,
        )

    def run(
        self,
        fn: StepFn,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> PyTree:
        """Run `fn(*args, **kwargs)` compiled on every replica of every process: `Strategy.run`.

        Everything `OneDeviceStrategy.run` says holds. In a job of several processes, every
        process must also call `run` with the same function, traced alike, at the same step:
        the processes compare the programs they ran at the 4th, 8th, 16th, 32nd and 64th calls,
        then every 64 (through JAX's coordination service, in a thread), and where one ran
        another program at some call (a branch on `jax.process_index()`, a closure made
        differently on one process), `run` raises on every process (the one that finds it, then
        the others through the job's exit watch), naming the call and both programs, instead of
        letting the collectives exchange mismatched data. It costs each call about a microsecond.

        Args:
          fn: the function to run; it must return a pytree of arrays.
          args: positional arguments, a tuple or list.
          kwargs: keyword arguments, a dict.
          options: a `RunOptions`.

        Returns:
          `fn`'s outputs; those that may differ between replicas as `PerReplica`.

        Raises:
          RuntimeError: the processes ran different step programs at some call (from then on,
            at every call), or another process of the job has ended.
          TypeError, ValueError, StrategyContextError: as `OneDeviceStrategy.run`.

        Example:
          >>> import jaxstrategy
          >>> strategy = jaxstrategy.MultiWorkerMirroredStrategy()   # this process alone here
          >>> print(strategy.run(lambda: jaxstrategy.get_replica_context().all_reduce('sum', 1)))
          4
        """
        # The program check's hook on every call (see cluster/program_agreement.py): in a job of
        # several processes, a list append, and a round with the others every CALLS_PER_ROUND
        # calls, handed to a thread. Its error, raised before the step, names both programs.
        if self._programs is not None:
            self._programs.record(fn)
        return super().run(fn, args, kwargs, options)

    def _replica_program(self, fn: StepFn) -> StepFn:
        # The program check's hook where a step is traced: its jaxpr names the program.
        program = super()._replica_program(fn)
        return program if self._programs is None else self._programs.fingerprinting(fn, program)

    def _before_checked_run(self) -> None:
        # Compiling and first steps take this path: a process that ended would leave them waiting.
        job_exits.raise_if_a_process_ended(f"{type(self).__name__}.run()")

    @property
    def _input_pipeline(self) -> tuple[int, int]:
        return self._pipeline

    @property
    def _batch_layout(self) -> ReplicaLayout:
        return dataclasses.replace(super()._batch_layout, input_timeout_s=self._input_timeout_s)


class MultiWorkerMirroredStrategy(JobMember):
    """Synchronous training on every device of several processes, one replica per device.

    Every process runs the same script and creates this strategy first, before any other JAX
    call. It finds its job through `cluster_resolver`, joins it (`jax.distributed.initialize`),
    and from then on behaves as `MirroredStrategy` over the devices of all processes:
    `num_replicas_in_sync` counts them all, `run` is one SPMD program over all of them, and
    `reduce`, `gather` and `put` give every process the same replicated result. Each process holds
    its own replicas' values: `experimental_local_results` returns those.

    Input: `experimental_distribute_dataset` has every process read the same source and keep its
    replicas' parts of each global batch; `distribute_datasets_from_function` calls `dataset_fn`
    once per process, with `InputContext(num_input_pipelines=jax.process_count(),
    input_pipeline_id=jax.process_index(), ...)`, so each process reads its own shard. Where the
    processes' inputs end at different steps, every process ends the pass at the first such step,
    with a warning, instead of one of them waiting forever.

    Without a resolver the job comes from the `TF_CONFIG` environment variable when it is set,
    else from a `jax.distributed` runtime already started in this process, else from a cluster
    JAX detects itself (SLURM, Open MPI, Kubernetes, Cloud TPU), else it is this process alone.
    A job JAX finds but cannot join (because JAX already started in this process) is an error,
    never a silent fall-back to one process.

    Joining the job leaves SIGTERM as it was (JAX's own handler, which would only log it, is
    taken out): it ends the process, unless the program handles it, with a
    `checkpoint.PreemptionHandler` say. Create the strategy in the main thread for that;
    elsewhere it warns (`RuntimeWarning`) that JAX's handler stays.

    Args:
      cluster_resolver: a `TFConfigClusterResolver`, a `SimpleClusterResolver`, or None (see
        above).
      initialization_timeout: seconds to wait for every process to join; then a message on
        stderr says what to check, and JAX ends the process soon after.
      heartbeat_timeout_seconds: seconds after which a process that stopped responding (it
        crashed, or was killed) counts as dead; JAX then ends every other process. Also how
        long a process whose program ended waits at exit for the others to end too: any still
        running then are ended (see the "Many hosts" guide), as are all of them at once when
        one raises an uncaught exception.
      input_timeout_seconds: seconds a process's distributed dataset waits for the other
        processes' at one step before it raises a `TimeoutError`: they wait forever when
        processes create or iterate datasets in different orders. Raise it if one process may
        pause for longer (say, the chief evaluating alone) while the others prefetch.

    Raises:
      TypeError: `cluster_resolver` is not a `ClusterResolver`; a timeout is not an int.
      ValueError: `TF_CONFIG` or the resolver's facts are malformed; this process's runtime
        already runs another job; a timeout is below 1; the processes have different numbers of
        devices (an `InvalidDeviceError`, raised on every process).
      RuntimeError: JAX already started in this process, so it can no longer join a job of
        several processes.

    Example:
      >>> import jaxstrategy
      >>> # No cluster here: this process alone.
      >>> strategy = jaxstrategy.MultiWorkerMirroredStrategy()
      >>> strategy.cluster_resolver.num_processes, strategy.cluster_resolver.task_type
      (1, None)
      >>> strategy.num_replicas_in_sync
      4
      >>> print(strategy.run(lambda: jaxstrategy.get_replica_context().all_reduce('sum', 1)))
      4
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        *,
        initialization_timeout: int = 300,
        heartbeat_timeout_seconds: int = 100,
        input_timeout_seconds: int = 3600,
    ):
        self._join(cluster_resolver, initialization_timeout, heartbeat_timeout_seconds, input_timeout_seconds)
        # Process by process, so that each process's replicas are consecutive.
        devices = tuple(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        require_same_devices_per_process(devices, _CALLER)
        super().__init__(devices)
        self._watch_job()

    def __repr__(self) -> str:
        return f"MultiWorkerMirroredStrategy(cluster_resolver={self._cluster_resolver!r})"


@dataclasses.dataclass(frozen=True)
class _Timeouts:
    initialization_timeout: int
    heartbeat_timeout_seconds: int
    caller: str = _CALLER  # The strategy joining, as its messages name it.


def _input_pipeline_of_this_process(devices: Sequence[Any], num_replicas: int) -> tuple[int, int]:
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


def require_same_devices_per_process(devices: Sequence[Any], caller: str) -> None:
    """Raise unless every process of the job has as many of `devices` as every other.

    `jax.devices()` lists every process's devices with their `process_index`, so each process
    finds the same answer, and raises the same error, without asking the others. Without this,
    processes with 2 and 1 devices made a strategy of 3 replicas whose first `put` failed in JAX
    with "cannot reshape array of size 3 into shape (2,2)" (`multihost_utils.process_allgather`
    lays the devices out as processes x devices per process), and whose distributed datasets
    gave each process a share of another shape.

    Args:
      devices: the devices of every process, as `jax.devices()` lists them.
      caller: the call to name in the message.

    Raises:
      InvalidDeviceError: (a `ValueError`) the processes have different numbers of devices; the
        message lists each count and the processes that have it.
    """
    per_process = collections.Counter(device.process_index for device in devices)
    if len(set(per_process.values())) <= 1:
        return
    by_count: dict[int, list[int]] = {}
    for process in sorted(per_process):
        by_count.setdefault(per_process[process], []).append(process)
    lines = [
        f"{count} device{'s' if count != 1 else ''}: process{'es' if len(processes) > 1 else ''} "
        f"{', '.join(map(str, processes))}"
        for count, processes in by_count.items()
    ]
    raise InvalidDeviceError(
        f"{caller}: the processes of this job have different numbers of devices:{bullet_list(lines)}\n"
        "Every process must have the same number, one replica per device: each process feeds and "
        "reads its own replicas, and JAX's arrays over several processes need as many on each. "
        "Start every process with the same devices (on GPUs, as many in CUDA_VISIBLE_DEVICES; on "
        "CPUs, the same --xla_force_host_platform_device_count in XLA_FLAGS)."
    )


def join_cluster(resolver: ClusterResolver | None, timeouts: _Timeouts) -> ClusterResolver:
    """Start JAX's distributed runtime for the job `resolver` describes (found when None), unless
    it runs already; return the resolver of the job this process is in."""
    if resolver is None:
        return _default_job(timeouts)
    if not isinstance(resolver, ClusterResolver):
        raise TypeError(
            f"{timeouts.caller[:-1]}cluster_resolver={resolver!r}): expected a "
            "jaxstrategy.TFConfigClusterResolver or SimpleClusterResolver (or another "
            "ClusterResolver), or None."
        )
    check_job(resolver, caller=f"{timeouts.caller}: {type(resolver).__name__}")
    if jax.distributed.is_initialized():
        _require_running_job(resolver, timeouts.caller)
    elif resolver.num_processes > 1:
        _start_runtime(resolver, timeouts)
    return resolver


def _default_job(timeouts: _Timeouts) -> ClusterResolver:
    """TF_CONFIG, else the runtime already running, else JAX's detection, else this process alone."""
    if os.environ.get("TF_CONFIG"):
        return join_cluster(TFConfigClusterResolver(), timeouts)
    if not jax.distributed.is_initialized():
        detected = jax_compat.detected_cluster()
        if detected is None:
            return ThisProcessResolver()
        _start_runtime(None, timeouts, detected=detected)
    return SimpleClusterResolver(jax_compat.coordinator_address(), jax.process_count(), jax.process_index())


def _require_running_job(resolver: ClusterResolver, caller: str) -> None:
    running = (jax.process_count(), jax.process_index())
    if running != (resolver.num_processes, resolver.process_id):
        raise ValueError(
            f"{caller}: JAX's distributed runtime already runs in this process as process "
            f"{running[1]} of {running[0]}, but the cluster resolver makes it process "
            f"{resolver.process_id} of {resolver.num_processes} ({resolver!r}). A process joins one "
            "job: pass a resolver for the job it is in, or none to use the running one."
        )


def _start_runtime(
    resolver: ClusterResolver | None, timeouts: _Timeouts, *, detected: str | None = None
) -> None:
    """`jax.distributed.initialize` for `resolver`'s job, or for the one JAX `detected` when None."""
    if resolver is not None:
        job = f"process {resolver.process_id} of {resolver.num_processes}"
        job += f", coordinator {resolver.coordinator_address}"
        where = f"the {type(resolver).__name__}'s job description"
    else:
        job, where = f"the {detected} job JAX detected", f"the {detected} job's settings"
    if jax_compat.backends_started():
        raise RuntimeError(
            f"{timeouts.caller}: cannot join {job}: JAX has already started in this process (something "
            "created an array or asked for devices), and a running JAX cannot join a job of several "
            "processes. Create the strategy first thing in the program, before any other JAX call. "
            "To train in this process alone, use MirroredStrategy or pass "
            "SimpleClusterResolver(None, num_processes=1, process_id=0)."
        )
    if resolver is not None and resolver.process_id == 0 and resolver.coordinator_address:
        _require_free_port(resolver.coordinator_address, timeouts.caller)
    started = threading.Event()
    watchdog = threading.Thread(
        target=_report_if_stuck,
        args=(started, timeouts.initialization_timeout, job, where, timeouts.caller),
        name="jaxstrategy-join-watchdog",
        daemon=True,
    )
    watchdog.start()
    sigterm = signal.getsignal(signal.SIGTERM)  # Before JAX replaces it.
    try:
        if resolver is None:  # JAX detects the job, as `jax.distributed.initialize()` does.
            jax.distributed.initialize(
                initialization_timeout=timeouts.initialization_timeout,
                heartbeat_timeout_seconds=timeouts.heartbeat_timeout_seconds,
            )
        else:
            # Detection off: the resolver gave every fact, and detection would also restrict each
            # process to one device under SLURM (its SLURM_LOCALID's).
            jax.distributed.initialize(
                resolver.coordinator_address,
                resolver.num_processes,
                resolver.process_id,
                cluster_detection_method="deactivate",
                initialization_timeout=timeouts.initialization_timeout,
                heartbeat_timeout_seconds=timeouts.heartbeat_timeout_seconds,
            )
    finally:
        started.set()
        watchdog.join()
    _put_back_sigterm(sigterm, timeouts.caller)


def _put_back_sigterm(
    handler: Callable[[int, FrameType | None], Any] | int | None, caller: str = _CALLER
) -> None:
    """Make `handler`, SIGTERM's before `jax.distributed.initialize`, SIGTERM's handler again.

    JAX's preemption service (`jax_enable_preemption_service`, on by default) installs a C++
    SIGTERM handler (XLA's `SigtermNotifier` in `preemption_notifier.cc`, with `std::signal`;
    seen in jax 0.10.2) that logs `SIGTERM caught at ...` and tells JAX's preemption sync point,
    nothing more: the process goes on, and a job its scheduler told to stop runs until it is
    killed. Python does not see that handler (`signal.getsignal` still says `SIG_DFL`), and a
    `PreemptionHandler`'s `close()` installs `SIG_DFL` for real, so SIGTERM ended a job after a
    handler had been closed, not before. With Python's handler back, SIGTERM does the same
    either way, as without `jax.distributed`. JAX's `reached_preemption_sync_point` (and orbax's
    saving on preemption, which uses it) then never sees a SIGTERM; a program that wants them
    calls `jax.distributed.initialize` itself before creating the strategy, which then leaves
    the runtime and its handler as they are.
    """
    if threading.current_thread() is threading.main_thread():
        if handler is not None:  # None: set outside Python, which cannot put it back.
            signal.signal(signal.SIGTERM, handler)
        return
    # Read as `jax.config.jax_enable_x64` is; the option is not in jax.config's type stubs.
    if getattr(jax.config, "jax_enable_preemption_service", True):
        warnings.warn(
            f"{caller}: created outside the main thread, where no signal handler can be set, so "
            "the SIGTERM handler that jax.distributed.initialize installed stays: a SIGTERM is "
            "logged by JAX's preemption notifier and this process goes on running. Create the "
            "strategy in the main thread, so that SIGTERM ends the process (or, with a "
            "jaxstrategy.checkpoint.PreemptionHandler, saves first).",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )


def _require_free_port(coordinator_address: str, caller: str) -> None:
    """Raise unless the coordinator's port is free here, in process 0, which serves it.

    JAX's coordination service listens on every interface (`[::]:port`); when the port is taken
    it crashes the process (SIGSEGV, measured with jax 0.10.2) instead of raising.
    """
    port = int(coordinator_address.rpartition(":")[2])
    for family, everywhere in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                # As the service does: a port left in TIME_WAIT by an earlier job is free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((everywhere, port))
            return
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise RuntimeError(
                    f"{caller}: this is process 0, which serves the job's coordinator at "
                    f"{coordinator_address}, but port {port} is already in use on this host. Stop "
                    "what holds it (an earlier run of this job, say), or give the job another "
                    "free port in TF_CONFIG or the cluster resolver."
                ) from None
            # No IPv6 here, say: try IPv4.
    # Neither family could bind for another reason; JAX's own start-up reports that.


def _report_if_stuck(started: threading.Event, timeout_s: int, job: str, where: str, caller: str) -> None:
    """Write what to check to stderr if joining takes longer than its timeout: JAX then ends the
    process from C++, with a message that blames a crashed task."""
    if started.wait(timeout_s):
        return
    sys.stderr.write(
        f"\njaxstrategy: {caller} could not join {job} within initialization_timeout="
        f"{timeout_s} s: the coordinator could not be reached, or not every process of the job has "
        f"started. JAX will now end this process. Check that every process started with the same "
        f"job ({where}), that the coordinator's host and port are right and reachable from here, "
        "and that the port is free on the coordinator's host.\n"
    )
    sys.stderr.flush()
