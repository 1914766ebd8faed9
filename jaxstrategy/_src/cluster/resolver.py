"""Cluster resolvers: which processes make up a multi-worker job, and which one this process is.

`MultiWorkerMirroredStrategy` needs three facts to start JAX's distributed runtime: the
coordinator's address, the number of processes and this process's id. TensorFlow describes a job
in its own words (a cluster spec of jobs and tasks, and this task's type and index); the
resolvers here answer in both, so code that branches on `cluster_resolver.task_type` keeps
working. Reading a resolver starts nothing: JAX is untouched until the strategy is made.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

from jaxstrategy._src.core.arguments import check_int, is_int
from jaxstrategy._src.core.errors import format_call

# The jobs whose tasks run the training program, in process order: the chief (if any) is
# process 0 and hosts JAX's coordinator, then the workers in order.
_TRAINING_JOBS = ("chief", "worker")
# Jobs TensorFlow's multi-worker strategy accepts in a cluster spec.
_KNOWN_JOBS = (*_TRAINING_JOBS, "ps", "evaluator")
_TF_CONFIG_EXAMPLE = (
    '{"cluster": {"worker": ["host0:12345", "host1:12345"]}, "task": {"type": "worker", "index": 0}}'
)


class ClusterResolver:
    """The processes of a multi-worker job, and this process's place among them.

    Subclasses set the attributes in their constructor; `MultiWorkerMirroredStrategy` reads
    `coordinator_address`, `num_processes` and `process_id`, and hands them to
    `jax.distributed.initialize`.

    Attributes:
      coordinator_address: `host:port` of process 0, where JAX's coordinator listens; None for
        a job of one process.
      num_processes: how many processes take part in training.
      process_id: this process's index among them, from 0; process 0 is the chief.
      task_type: TensorFlow's name for this process's job: `'chief'`, `'worker'`, `'evaluator'`.
      task_id: this process's index within its job.

    Example:
      A resolver for a launcher of one's own sets the five attributes:

      >>> import os, jaxstrategy
      >>> class EnvironmentResolver(jaxstrategy.ClusterResolver):
      ...     def __init__(self):
      ...         self.coordinator_address = os.environ.get('MY_COORDINATOR', 'host0:1234')
      ...         self.num_processes = int(os.environ.get('MY_NUM_PROCESSES', '2'))
      ...         self.process_id = int(os.environ.get('MY_PROCESS_ID', '1'))
      ...         self.task_type, self.task_id = 'worker', self.process_id
      >>> EnvironmentResolver()
      EnvironmentResolver(coordinator_address='host0:1234', num_processes=2, process_id=1,
                          task_type='worker', task_id=1)
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int
    task_type: str | None
    task_id: int | None

    def cluster_spec(self) -> dict[str, list[str]]:
        """The job's addresses by job name, as TensorFlow's `ClusterSpec.as_dict()`; {} when unknown."""
        return {}

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task, as TensorFlow's `master()`: this process's task by default.

        Returns:
          `host:port` from `cluster_spec()`, as `rpc_layer://host:port` when `rpc_layer` is given;
          `''` when the job lists no such task (a job of one process, say).

        Example:
          >>> import jaxstrategy
          >>> resolver = jaxstrategy.SimpleClusterResolver(
          ...     'host0:1234', num_processes=2, process_id=0)
          >>> resolver.master(), resolver.master(rpc_layer='grpc'), resolver.master('worker', 1)
          ('host0:1234', 'grpc://host0:1234', '')
        """
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        address = self._task_address(task_type, task_id)
        return f"{rpc_layer}://{address}" if rpc_layer and address else address

    def _task_address(self, task_type: str | None, task_id: int | None) -> str:
        addresses = self.cluster_spec().get(task_type, []) if task_type is not None else []
        return addresses[task_id] if task_id is not None and 0 <= task_id < len(addresses) else ""

    def num_accelerators(self) -> dict[str, int]:
        """The accelerators this process's JAX sees, by kind, such as `{'GPU': 8}`; {} on CPU.

        This asks JAX for its devices, which starts JAX's backend; a process that has not joined
        its cluster yet could then no longer join. So in a job of several processes it is an
        error until JAX's distributed runtime has started (by creating the strategy).

        Raises:
          RuntimeError: called in a job of several processes before the strategy was created.
        """
        if self.num_processes > 1 and not jax.distributed.is_initialized():
            raise RuntimeError(
                f"{type(self).__name__}.num_accelerators(): this is process {self.process_id} of "
                f"{self.num_processes}, and JAX's distributed runtime has not started. Counting devices "
                "would start JAX's backend, after which this process could not join the cluster. "
                "Create the MultiWorkerMirroredStrategy first, then call num_accelerators()."
            )
        counts: dict[str, int] = {}
        for device in jax.local_devices():
            if device.platform != "cpu":
                kind = device.platform.upper()
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(coordinator_address={self.coordinator_address!r}, "
            f"num_processes={self.num_processes}, process_id={self.process_id}, "
            f"task_type={self.task_type!r}, task_id={self.task_id})"
        )


class SimpleClusterResolver(ClusterResolver):
    """A cluster given by JAX's own three facts: coordinator address, process count, process id.

    Use it where the job is started by a launcher that is neither TensorFlow's `TF_CONFIG` nor
    one JAX detects by itself. Every process is a `'worker'`, and its `task_id` is its
    `process_id`. TensorFlow's class of this name takes a cluster spec instead.

    Args:
      coordinator_address: `host:port` of process 0, reachable from every process; JAX's
        coordinator listens on that port. May be None for a single process.
      num_processes: how many processes take part, >= 1.
      process_id: this process's index, in `[0, num_processes)`; 0 hosts the coordinator.

    Raises:
      ValueError: the address is not `host:port`, or the counts are out of range.
      TypeError: a count is not an int.

    Example:
      >>> import jaxstrategy
      >>> resolver = jaxstrategy.SimpleClusterResolver(
      ...     '10.0.0.1:1234', num_processes=2, process_id=1)
      >>> resolver.task_type, resolver.task_id, resolver.num_processes
      ('worker', 1, 2)
    """

    def __init__(self, coordinator_address: str | None, num_processes: int, process_id: int):
        self.coordinator_address = coordinator_address
        self.num_processes = num_processes
        self.process_id = process_id
        self.task_type = "worker"
        self.task_id = process_id
        check_job(self, caller="SimpleClusterResolver()")

    def _task_address(self, task_type: str | None, task_id: int | None) -> str:
        # Only process 0's address is known: the coordinator's.
        return self.coordinator_address or "" if (task_type, task_id) == ("worker", 0) else ""


def check_job(resolver: ClusterResolver, *, caller: str) -> None:
    """Raise unless `resolver`'s three facts describe a job JAX can start.

    Messages name the resolver's facts as its constructor's arguments, after `caller` where that
    is another call (the strategy given the resolver): `SimpleClusterResolver(process_id=True):
    ...`, or `MultiWorkerMirroredStrategy(): TFConfigClusterResolver(num_processes=0): ...`.

    Args:
      resolver: the resolver to check.
      caller: the call to name in messages, such as `SimpleClusterResolver()`.

    Raises:
      TypeError: a fact is missing, or a count is not an int.
      ValueError: a count is out of range, or the coordinator's address is not `host:port`.
    """
    constructor = f"{type(resolver).__name__}()"
    prefix = "" if caller == constructor else f"{caller}: "

    def facts_as_given(arguments: str) -> str:
        return prefix + format_call(constructor, arguments)

    facts = {}
    for name in ("coordinator_address", "num_processes", "process_id"):
        if not hasattr(resolver, name):
            raise TypeError(
                f"{prefix}{type(resolver).__name__} has no attribute {name!r}: a ClusterResolver sets "
                "coordinator_address, num_processes, process_id, task_type and task_id in its "
                "constructor."
            )
        facts[name] = getattr(resolver, name)
    address, num_processes, process_id = facts.values()
    for name in ("num_processes", "process_id"):
        value = facts[name]
        check_int(value, facts_as_given(f"{name}={value!r}"), not_int=TypeError)
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise ValueError(
            f"{facts_as_given(f'num_processes={num_processes}, process_id={process_id}')}: expected "
            "num_processes >= 1 and 0 <= process_id < num_processes."
        )
    if address is None:
        if num_processes > 1:
            raise ValueError(
                f"{facts_as_given(f'coordinator_address=None, num_processes={num_processes}')}: a "
                "job of several processes needs the coordinator's 'host:port' (process 0's host, "
                "and a free port there)."
            )
        return
    problem = address_problem(address)
    if problem:
        raise ValueError(
            f"{facts_as_given(f'coordinator_address={address!r}')}: {problem}; expected "
            "'host:port', such as '10.0.0.1:1234'."
        )


class ThisProcessResolver(ClusterResolver):
    """A job of this process alone, found where there is no cluster to join. Like TensorFlow's
    resolver without `TF_CONFIG`, it has no task type or id."""

    def __init__(self) -> None:
        self.coordinator_address = None
        self.num_processes = 1
        self.process_id = 0
        self.task_type = None
        self.task_id = None


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by the `TF_CONFIG` environment variable, read as TensorFlow reads it.

    `TF_CONFIG` is JSON with a `cluster` (job name to a list of `host:port`) and this process's
    `task` (`type` and `index`). The `'chief'` task (if any) and the `'worker'` tasks train, in
    that order: the first of them is process 0, and JAX's coordinator listens on its address.
    `'ps'` tasks may be listed and are not part of training (there are no parameter servers);
    an `'evaluator'` task runs on its own, as a job of one process, as in TensorFlow.

    Args:
      task_type: overrides `TF_CONFIG`'s task type.
      task_id: overrides `TF_CONFIG`'s task index.

    Raises:
      ValueError: `TF_CONFIG` is unset, is not JSON, or does not describe a cluster this process
        can train in; the message says which part is wrong.

    Example:
      >>> import json, os, jaxstrategy
      >>> os.environ['TF_CONFIG'] = json.dumps({
      ...     'cluster': {
      ...         'worker': ['localhost:12345', 'localhost:23456'],
      ...         'ps': ['localhost:34567'],
      ...     },
      ...     'task': {'type': 'worker', 'index': 1}})
      >>> resolver = jaxstrategy.TFConfigClusterResolver()
      >>> resolver.task_type, resolver.task_id, resolver.process_id
      ('worker', 1, 1)
      >>> resolver.coordinator_address
      'localhost:12345'
      >>> del os.environ['TF_CONFIG']
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None):
        if task_type is not None and not isinstance(task_type, str):
            raise TypeError(f"TFConfigClusterResolver(task_type={task_type!r}): expected a str or None.")
        check_int(
            task_id, f"TFConfigClusterResolver(task_id={task_id!r})", allow_none=True, not_int=TypeError
        )
        config = _parse_tf_config(os.environ.get("TF_CONFIG"))
        self._cluster = _parse_cluster(config.get("cluster"))
        task = config.get("task", {})
        if not isinstance(task, dict):
            raise _tf_config_error(f"has a 'task' that is a {type(task).__name__}, not an object")
        self.task_type = task_type if task_type is not None else task.get("type")
        self.task_id = task_id if task_id is not None else task.get("index", 0)
        self.process_id, self.num_processes = _place_task(self._cluster, self.task_type, self.task_id)
        training = [address for job in _TRAINING_JOBS for address in self._cluster.get(job, [])]
        self.coordinator_address = training[0] if self.num_processes > 1 else None

    def cluster_spec(self) -> dict[str, list[str]]:
        """`TF_CONFIG`'s cluster: job names to their tasks' addresses."""
        return {job: list(addresses) for job, addresses in self._cluster.items()}


def address_problem(address: Any) -> str | None:
    """What is wrong with `address` as `host:port`, or None when nothing is."""
    if not isinstance(address, str):
        return f"it is a {type(address).__name__}, not a string"
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return "it has no port"
    if not port.isdigit() or not 0 < int(port) < 65536:
        return f"its port {port!r} is not a number from 1 to 65535"
    return None


def _tf_config_error(problem: str) -> ValueError:
    return ValueError(f"TF_CONFIG {problem}. A valid one looks like {_TF_CONFIG_EXAMPLE}.")


def _parse_tf_config(text: str | None) -> dict[str, Any]:
    if not text:
        raise ValueError(
            "TFConfigClusterResolver(): the TF_CONFIG environment variable is not set. Set it in "
            f"every process to JSON such as {_TF_CONFIG_EXAMPLE} (with that process's task), or pass "
            "a SimpleClusterResolver."
        )
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise _tf_config_error(f"is not valid JSON ({error}): {text[:200]!r}") from error
    if not isinstance(config, dict):
        raise _tf_config_error(f"is a JSON {type(config).__name__}, not an object")
    return config


def _parse_cluster(cluster: Any) -> dict[str, list[str]]:
    if not isinstance(cluster, dict) or not cluster:
        raise _tf_config_error("has no 'cluster' object naming the jobs' addresses")
    unknown = sorted(set(cluster) - set(_KNOWN_JOBS))
    if unknown:
        raise _tf_config_error(
            f"names job(s) {unknown} in its cluster; MultiWorkerMirroredStrategy knows {list(_KNOWN_JOBS)}"
        )
    seen: dict[str, str] = {}
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or not addresses:
            raise _tf_config_error(
                f"has cluster[{job!r}] = {addresses!r}, which is not a list of 'host:port'"
            )
        for i, address in enumerate(addresses):
            problem = address_problem(address)
            if problem:
                raise _tf_config_error(f"has cluster[{job!r}][{i}] = {address!r}, and {problem}")
            if address in seen:
                raise _tf_config_error(
                    f"lists {address!r} twice (as {seen[address]} and {job}:{i}); every task needs its own "
                    "address"
                )
            seen[address] = f"{job}:{i}"
    if len(cluster.get("chief", [])) > 1:
        raise _tf_config_error(f"lists {len(cluster['chief'])} chiefs; a cluster has at most one")
    if not any(job in cluster for job in _TRAINING_JOBS):
        raise _tf_config_error("has no 'chief' or 'worker' job, so no process would train")
    return cluster


def _place_task(cluster: dict[str, list[str]], task_type: Any, task_id: Any) -> tuple[int, int]:
    """This task's process id, and the number of processes it trains with."""
    if not is_int(task_id):
        raise _tf_config_error(f"has task index {task_id!r}, which is not an int")
    if task_type == "evaluator":
        return 0, 1  # An evaluator trains with no one: a job of one process, as in TensorFlow.
    if task_type == "ps":
        raise ValueError(
            "TF_CONFIG makes this process a 'ps' task, but MultiWorkerMirroredStrategy has no "
            "parameter servers: only 'chief' and 'worker' tasks run it. Leave ps tasks out of the job "
            "(their entries in the cluster may stay)."
        )
    if task_type not in _TRAINING_JOBS:
        raise _tf_config_error(
            f"has task type {task_type!r}, which is none of {list(_TRAINING_JOBS)} (or 'evaluator')"
        )
    tasks = cluster.get(task_type, [])
    if not 0 <= task_id < len(tasks):
        raise _tf_config_error(
            f"has task {{'type': {task_type!r}, 'index': {task_id}}}, but the cluster lists "
            f"{len(tasks)} {task_type} task(s)"
        )
    chiefs = len(cluster.get("chief", []))
    process_id = task_id if task_type == "chief" else chiefs + task_id
    return process_id, chiefs + len(cluster.get("worker", []))
