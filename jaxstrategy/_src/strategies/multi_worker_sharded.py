"""`MultiWorkerShardedStrategy`: ShardedStrategy's replicas over the devices of many processes.

The job is joined as `MultiWorkerMirroredStrategy` joins it (`job.JobOfProcesses`); the
placement is then `ShardedStrategy`'s, `('replica', 'shard'[, 'model'])`, over every device of every
process. The devices are ordered host by host, then process by process, so that consecutive
devices (one replica's) share a host's fast links: by default each host holds one replica, its
model split over the host's devices, and the replicas are combined across hosts (the hybrid
layout of PyTorch FSDP's `HYBRID_SHARD` and MaxText's `ici_fsdp_parallelism` with
`dcn_data_parallelism`). A host is what `socket.gethostname()` names, gathered from every
process through JAX's coordination service: a launch of one process per GPU (SLURM's, say) then
still splits each replica over the whole host.
"""

from __future__ import annotations

import collections
import socket
from collections.abc import Sequence
from typing import Any

import jax

from jaxstrategy._src.cluster.coordination import every_process_value
from jaxstrategy._src.cluster.resolver import ClusterResolver
from jaxstrategy._src.core.device_spec import require_same_devices_per_process, spans_processes
from jaxstrategy._src.core.errors import InvalidDeviceError, bullet_list
from jaxstrategy._src.strategies.job import JobOfProcesses
from jaxstrategy._src.strategies.layout_rules import DEFAULT_MIN_SHARD_BYTES
from jaxstrategy._src.strategies.sharded import ShardedStrategy
from jaxstrategy._src.strategies.sharded_placement import ShardedPlacement
from jaxstrategy._src.strategies.strategy import Strategy

_CALLER = "MultiWorkerShardedStrategy()"


class MultiWorkerShardedStrategy(ShardedStrategy):
    """`ShardedStrategy` over the devices of several processes: models bigger than one host's
    devices' memory, or data parallel across hosts with each replica split within one.

    Every process runs the same script and creates this strategy first, before any other JAX
    call; it joins the job as `MultiWorkerMirroredStrategy` does (`TF_CONFIG`, a resolver, or
    the cluster JAX detects: SLURM, Open MPI, Kubernetes). Then everything works as on
    `ShardedStrategy`, over every device of the job: `run` calls `fn` once per replica,
    `all_reduce` combines across replicas, and each replica's variables are split over its
    devices by the same layout rules. Each process holds the parts of the variables on its own
    devices, feeds its own replicas, and saves only its own shards (`checkpoint.save`).

    The layout. The devices are ordered host by host, process by process. By default there is
    one replica per host: its model is split over the host's devices (`'shard'`, and `'model'`
    with `model_parallel`), over the fast links within the host, and only the gradients cross
    hosts. `num_replicas` chooses another split: more replicas (each within a process, or over
    several processes of a host), or fewer (a replica over several hosts, whose every step then
    gathers parameters over the network). Every replica must be made of whole processes, or
    every process of whole replicas: a process holding parts of two replicas could not feed
    them.

    Input: `experimental_distribute_dataset` has every process read the same source and keep its
    replicas' parts of each batch. `distribute_datasets_from_function` calls `dataset_fn` with
    one input pipeline per replica group: processes that share a replica get the same
    `input_pipeline_id` and must read the same batches for it.

    Args:
      cluster_resolver: as for `MultiWorkerMirroredStrategy`.
      num_replicas: R, how many replicas; None means one per host.
      model_parallel: M, the size of the `'model'` axis within each replica (see
        `ShardedStrategy`).
      layout: `(regex, spec)` rules, as for `ShardedStrategy`.
      min_shard_bytes: as for `ShardedStrategy`.
      initialization_timeout: as for `MultiWorkerMirroredStrategy`.
      heartbeat_timeout_seconds: as for `MultiWorkerMirroredStrategy`.
      input_timeout_seconds: as for `MultiWorkerMirroredStrategy`.

    Raises:
      ValueError: the job does not fit the layout, on every process alike: the processes have
        different numbers of devices; `num_replicas` does not divide the devices, or (by default)
        the hosts have different numbers of devices; a replica would hold part of a process's
        devices and part of another's; `model_parallel` does not divide a replica's devices.
        Also as for `MultiWorkerMirroredStrategy` and `ShardedStrategy`.
      TypeError, RuntimeError: as for `MultiWorkerMirroredStrategy`.

    Example:
      >>> import jaxstrategy
      >>> # No cluster here: this process alone, one host, so one replica over its devices.
      >>> strategy = jaxstrategy.MultiWorkerShardedStrategy()
      >>> strategy.num_replicas_in_sync, strategy.devices_per_replica
      (1, 4)
      >>> jaxstrategy.MultiWorkerShardedStrategy(num_replicas=2).devices_per_replica
      2
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        *,
        num_replicas: int | None = None,
        model_parallel: int = 1,
        layout: Sequence[tuple[str, Any]] | None = None,
        min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
        initialization_timeout: int = 300,
        heartbeat_timeout_seconds: int = 100,
        input_timeout_seconds: int = 3600,
    ):
        if num_replicas is not None and (
            isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1
        ):
            raise ValueError(
                f"{_CALLER}: num_replicas must be a positive int, or None for one replica per host; "
                f"got {num_replicas!r}."
            )
        job = JobOfProcesses.join(
            cluster_resolver,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
            input_timeout_seconds=input_timeout_seconds,
            caller=_CALLER,
        )
        require_same_devices_per_process(jax.devices(), _CALLER)
        # As long as joining may take: every process reaches this point once it has joined.
        hosts = _host_of_each_process(timeout_s=initialization_timeout)
        devices = ordered_by_host(jax.devices(), hosts)
        if num_replicas is None:
            num_replicas = _one_replica_per_host(devices, hosts)
        require_whole_processes(devices, num_replicas)
        placement = ShardedPlacement(
            devices,
            num_replicas=num_replicas,
            model_parallel=model_parallel,
            layout=layout,
            min_shard_bytes=min_shard_bytes,
            caller=_CALLER,
        )
        # Not ShardedStrategy's constructor, which takes this process's devices: the parts alone.
        Strategy.__init__(self, placement, job)

    def __repr__(self) -> str:
        return (
            f"MultiWorkerShardedStrategy(cluster_resolver={self.cluster_resolver!r}, "
            f"num_replicas={self.num_replicas_in_sync}, model_parallel={self.model_parallel}, "
            f"layout={list(self._rules.rules)!r}, min_shard_bytes={self._rules.min_shard_bytes})"
        )


def _host_of_each_process(timeout_s: float) -> dict[int, str]:
    """Each process's host name, by process index: gathered once per strategy (every process
    creates it, in the same order), without a call to the service in a job of one.

    Raises:
      TimeoutError: some process did not create the strategy within `timeout_s`.
    """
    if jax.process_count() == 1:
        return {0: socket.gethostname()}
    return every_process_value(socket.gethostname(), caller=_CALLER, timeout_s=timeout_s)


def ordered_by_host(devices: Sequence[jax.Device], hosts: dict[int, str]) -> tuple[jax.Device, ...]:
    """`devices` host by host (in the order of each host's first process), then process by
    process, then by id: consecutive devices share a host, and a process's devices are together."""
    first_process: dict[str, int] = {}
    for process in sorted(hosts):
        first_process.setdefault(hosts[process], process)

    def place(device: jax.Device) -> tuple[int, int, int]:
        return (first_process[hosts[device.process_index]], device.process_index, device.id)

    return tuple(sorted(devices, key=place))


def _one_replica_per_host(devices: Sequence[jax.Device], hosts: dict[int, str]) -> int:
    """The number of hosts, where each has as many devices; else a ValueError naming each."""
    per_host = collections.Counter(hosts[device.process_index] for device in devices)
    if len(set(per_host.values())) > 1:
        lines = [f"{host}: {count} devices" for host, count in sorted(per_host.items())]
        raise InvalidDeviceError(
            f"{_CALLER}: the hosts of this job have different numbers of devices, so one replica "
            f"per host (the default) would make replicas of different sizes:{bullet_list(lines)}\n"
            "Give every host as many processes and devices, or pass num_replicas= so that every "
            "replica is made of whole processes."
        )
    return len(per_host)


def require_whole_processes(devices: Sequence[jax.Device], num_replicas: int) -> None:
    """Raise unless every replica is made of whole processes, or every process of whole replicas.

    Each process feeds the replicas it holds devices of; a process holding parts of two replicas,
    each shared with another process, could not (and its input pipeline would be shared with
    two groups of processes at once).

    Raises:
      ValueError: `num_replicas` does not divide the devices, or a replica and a process cut
        across each other; the message says which counts fit.
    """
    if not spans_processes(devices) or len(devices) % num_replicas:
        return  # One process; or `ShardedPlacement` explains the division.
    per_replica = len(devices) // num_replicas
    per_process = len(devices) // jax.process_count()
    if per_replica % per_process == 0 or per_process % per_replica == 0:
        return
    sizes = [len(devices) // r for r in range(1, len(devices) + 1) if len(devices) % r == 0]
    fitting = [len(devices) // size for size in sizes if size % per_process == 0 or per_process % size == 0]
    raise ValueError(
        f"{_CALLER}: num_replicas={num_replicas} makes replicas of {per_replica} devices, which "
        f"cut across the processes' {per_process} devices each: some process would hold parts of "
        "two replicas, each shared with another process, and could feed neither. Every replica must "
        "be made of whole processes, or every process of whole replicas: choose num_replicas among "
        f"{fitting}."
    )
