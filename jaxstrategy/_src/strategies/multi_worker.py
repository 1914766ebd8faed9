"""`MultiWorkerMirroredStrategy`: MirroredStrategy's one program over the devices of many processes.

A job joined through `jax.distributed` (`job.py`, `cluster/joining.py`) and a
`ReplicatedPlacement` over every device of every process, ordered process by process. XLA's
collectives (gloo on CPU, NCCL on GPU) do the communication; jaxstrategy opens no connection of
its own.
"""

from __future__ import annotations

import jax

from jaxstrategy._src.cluster.resolver import ClusterResolver
from jaxstrategy._src.core.device_spec import require_same_devices_per_process
from jaxstrategy._src.strategies.job import JobOfProcesses
from jaxstrategy._src.strategies.replicated import ReplicatedPlacement
from jaxstrategy._src.strategies.strategy import Strategy

_CALLER = "MultiWorkerMirroredStrategy()"


class MultiWorkerMirroredStrategy(Strategy):
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

    Every process must call `run` with the same function, traced alike, at the same step. The
    processes compare the programs they ran at the 4th, 8th, 16th, 32nd and 64th calls, then
    every 64 (through JAX's coordination service, in a thread); where one ran another program
    at some call (a branch on `jax.process_index()`, a closure made differently on one
    process), `run` raises a `RuntimeError` on every process (the one that finds it, then the
    others through the job's exit watch), naming the call and both programs, instead of letting
    the collectives exchange mismatched data. It costs each call about a microsecond.

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
        job = JobOfProcesses.join(
            cluster_resolver,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            input_timeout_seconds=input_timeout_seconds,
            caller=_CALLER,
        )
        # Process by process, so that each process's replicas are consecutive.
        devices = tuple(sorted(jax.devices(), key=lambda d: (d.process_index, d.id)))
        require_same_devices_per_process(devices, _CALLER)
        super().__init__(ReplicatedPlacement(devices, caller=_CALLER), job)

    def __repr__(self) -> str:
        return f"MultiWorkerMirroredStrategy(cluster_resolver={self.cluster_resolver!r})"
