"""Joining a job of several processes: JAX's distributed runtime started once per process.

The job comes from a cluster resolver, `TF_CONFIG`, a runtime already running, or what JAX
detects (SLURM, Open MPI, Kubernetes). Starting it can fail in ways JAX reports by ending the
process from C++, so the start is watched and explained on stderr; and JAX's own SIGTERM handler,
which only logs the signal, is taken out again (see the "Internals" page of the docs).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import jax

from jaxstrategy._src.cluster.resolver import (
    ClusterResolver,
    SimpleClusterResolver,
    TFConfigClusterResolver,
    ThisProcessResolver,
    check_job,
)
from jaxstrategy._src.core import jax_compat
from jaxstrategy._src.core.errors import caller_stacklevel, format_call


@dataclasses.dataclass(frozen=True)
class JoinSettings:
    """How long joining may take, and the strategy's constructor that joins (`caller`, such as
    `MultiWorkerMirroredStrategy()`), as its messages name it."""

    initialization_timeout: int
    heartbeat_timeout_seconds: int
    caller: str


def join_cluster(resolver: ClusterResolver | None, settings: JoinSettings) -> ClusterResolver:
    """Start JAX's distributed runtime for the job `resolver` describes (found when None), unless
    it runs already; return the resolver of the job this process is in."""
    if resolver is None:
        return _default_job(settings)
    if not isinstance(resolver, ClusterResolver):
        raise TypeError(
            f"{format_call(settings.caller, f'cluster_resolver={resolver!r}')}: expected a "
            "jaxstrategy.TFConfigClusterResolver or SimpleClusterResolver (or another "
            "ClusterResolver), or None."
        )
    check_job(resolver, caller=settings.caller)
    if jax.distributed.is_initialized():
        _require_running_job(resolver, settings.caller)
    elif resolver.num_processes > 1:
        _start_runtime(resolver, settings)
    return resolver


def _default_job(settings: JoinSettings) -> ClusterResolver:
    """TF_CONFIG, else the runtime already running, else JAX's detection, else this process alone."""
    if os.environ.get("TF_CONFIG"):
        return join_cluster(TFConfigClusterResolver(), settings)
    if not jax.distributed.is_initialized():
        detected = jax_compat.detected_cluster()
        if detected is None:
            return ThisProcessResolver()
        _start_runtime(None, settings, detected=detected)
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
    resolver: ClusterResolver | None, settings: JoinSettings, *, detected: str | None = None
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
            f"{settings.caller}: cannot join {job}: JAX has already started in this process (something "
            "created an array or asked for devices), and a running JAX cannot join a job of several "
            "processes. Create the strategy first thing in the program, before any other JAX call. "
            "To train in this process alone, use MirroredStrategy or pass "
            "SimpleClusterResolver(None, num_processes=1, process_id=0)."
        )
    if resolver is not None and resolver.process_id == 0 and resolver.coordinator_address:
        _require_free_port(resolver.coordinator_address, settings.caller)
    started = threading.Event()
    watchdog = threading.Thread(
        target=_report_if_stuck,
        args=(started, settings.initialization_timeout, job, where, settings.caller),
        name="jaxstrategy-join-watchdog",
        daemon=True,
    )
    watchdog.start()
    sigterm = signal.getsignal(signal.SIGTERM)  # Before JAX replaces it.
    try:
        if resolver is None:  # JAX detects the job, as `jax.distributed.initialize()` does.
            jax.distributed.initialize(
                initialization_timeout=settings.initialization_timeout,
                heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
            )
        else:
            # Detection off: the resolver gave every fact, and detection would also restrict each
            # process to one device under SLURM (its SLURM_LOCALID's).
            jax.distributed.initialize(
                resolver.coordinator_address,
                resolver.num_processes,
                resolver.process_id,
                cluster_detection_method="deactivate",
                initialization_timeout=settings.initialization_timeout,
                heartbeat_timeout_seconds=settings.heartbeat_timeout_seconds,
            )
    finally:
        started.set()
        watchdog.join()
    put_back_sigterm(sigterm, settings.caller)


def put_back_sigterm(handler: Callable[[int, FrameType | None], Any] | int | None, caller: str) -> None:
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
