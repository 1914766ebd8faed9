"""Ending every process of a multi-process job soon after one of them ends early.

A process that raises or exits mid-loop would hang the job: it waits at JAX's shutdown for the
others, which wait in a collective for it, while JAX's heartbeat sees every process alive. So each
process announces its end, with the reason, in the coordination service's store, and a thread in
each one watches for the others' (docs/internals.md, "The cluster", gives the rules).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import types
from typing import Any

from jaxstrategy._src.cluster.coordination import PREFIX, KeyValueStore

_PREFIX = f"{PREFIX}/ended/"
_POLL_S = 0.5
# How long a process that failed waits for the others to see its failure before it ends.
_FAILED_WAIT_S = 10.0
# How long process 0, which serves the coordination service, outlives the others when it ends
# them: JAX aborts every process whose service goes away (SIGABRT, with a C++ stack trace).
_SERVICE_GRACE_S = 2.0
# How the reasons of the ends that end the job begin.
_FATAL = ("failed", "left")
# The exit status of a process ended here: Python's for an uncaught exception.
EXIT_STATUS = 1


class _Watch:
    """One process's view of its job's ends: what it announced, and what it has seen."""

    def __init__(self, store: KeyValueStore, process_id: int, num_processes: int, heartbeat_s: float):
        self.store = store
        self.process_id = process_id
        self.num_processes = num_processes
        self.heartbeat_s = heartbeat_s
        self.failure: str | None = None  # This process's uncaught exception, once raised.
        self.ended_elsewhere: dict[int, str] = {}
        self.ending = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="jaxstrategy-job-exits", daemon=True)

    def describe(self, process: int) -> str:
        return f"process {process} of {self.num_processes}"

    def others_ended(self) -> dict[int, str]:
        """The other processes that announced their end, with their reasons."""
        try:
            entries = self.store.values_under(_PREFIX)
        except Exception:  # The service is gone: JAX reports that itself.
            return {}
        ended = {}
        for key, reason in entries.items():
            process = int(key.rpartition("/")[2])
            if process != self.process_id:
                ended[process] = reason
        return ended

    def announce(self, reason: str) -> None:
        try:
            self.store.set(f"{_PREFIX}{self.process_id}", reason, overwrite=True)
        except Exception:  # The service is gone: nobody is left to tell.
            pass

    def _watch(self) -> None:
        while not self.ending.wait(_POLL_S) and self.store.is_current():
            for process, reason in self.others_ended().items():
                self.ended_elsewhere[process] = reason
                if reason.startswith(_FATAL):
                    self._end_because_of(process, reason)

    def _end_because_of(self, process: int, reason: str) -> None:
        if self.ending.is_set():
            return
        self.ending.set()
        _say(
            f"{self.describe(process)} {reason}. The job cannot go on without it, so "
            f"{self.describe(self.process_id)} ends now (exit status {EXIT_STATUS})."
        )
        self.announce(f"stopped because {self.describe(process)} failed")
        self._exit_now()

    def on_exit(self) -> None:
        """Announce this process's end and, unless the whole job is ending, end it at once."""
        if self.ending.is_set():
            return
        self.ending.set()
        self.thread.join()
        if not self.store.is_current():
            return  # The program shut JAX down itself: its shutdown waited for every process.
        if self.failure is not None:
            self.announce(f"failed with {self.failure}")
            self._wait_for_others(_FAILED_WAIT_S)
            self._exit_now()
        self.announce("ended: its program returned or called sys.exit")
        running = self._wait_for_others(self.heartbeat_s)
        if running:
            names = ", ".join(str(p) for p in running)
            _say(
                f"{self.describe(self.process_id)} has ended, but process(es) {names} are still "
                f"running after heartbeat_timeout_seconds={self.heartbeat_s:g} s, and may be "
                "waiting for it in a step. Every process must make the same calls: this one now "
                f"ends at once (exit status {EXIT_STATUS}), and so do they."
            )
            self.announce(f"left the job: its program ended while process(es) {names} went on")
            time.sleep(2 * _POLL_S)  # For their watchers to read why before their steps fail.
            self._exit_now()

    def _exit_now(self) -> None:
        """End this process without waiting for the others at JAX's shutdown."""
        if self.process_id == 0:
            time.sleep(_SERVICE_GRACE_S)
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(EXIT_STATUS)

    def _wait_for_others(self, timeout_s: float) -> list[int]:
        """Wait until every other process announced its end; return those that did not."""
        deadline = time.monotonic() + timeout_s
        while True:
            running = sorted(set(range(self.num_processes)) - {self.process_id} - set(self.others_ended()))
            if not running or time.monotonic() >= deadline:
                return running
            time.sleep(_POLL_S / 5)


_watch: _Watch | None = None


def watch_job(process_id: int, num_processes: int, heartbeat_s: float, *, client: Any = None) -> None:
    """Start watching the job's ends, once per process (docs/internals.md, "The cluster"); through
    `client`, JAX's coordination client when None."""
    global _watch
    if _watch is not None or num_processes < 2:
        return
    _watch = _Watch(KeyValueStore(client), process_id, num_processes, heartbeat_s)
    previous_hook = sys.excepthook

    def record_failure(
        kind: type[BaseException], error: BaseException, trace: types.TracebackType | None
    ) -> None:
        assert _watch is not None
        _watch.failure = f"{kind.__name__}: {error}".splitlines()[0][:500]
        previous_hook(kind, error, trace)
        _watch.ended_elsewhere.update(_watch.others_ended())  # What the last poll may have missed.
        if _watch.ended_elsewhere:
            ended = "; ".join(f"{_watch.describe(p)} {r}" for p, r in sorted(_watch.ended_elsewhere.items()))
            _say(f"before this error, {ended}.")

    sys.excepthook = record_failure
    # Registered after JAX's own shutdown (registered when jax is imported), so it runs first.
    atexit.register(_watch.on_exit)
    _watch.thread.start()


def raise_if_a_process_ended(caller: str) -> None:
    """Raise a RuntimeError naming the processes of the job that have ended, if any have."""
    if _watch is None:
        return
    fatal = {p: r for p, r in _watch.ended_elsewhere.items() if r.startswith(_FATAL)}
    if not fatal:
        return
    ended = "; ".join(f"{_watch.describe(p)} {r}" for p, r in sorted(fatal.items()))
    raise RuntimeError(
        f"{caller}: {ended}. A step needs every process of the job, so it would wait forever. "
        "Every process must make the same calls in the same order; see the other process's log "
        "for why it ended."
    )


def _say(message: str) -> None:
    sys.stderr.write(f"\njaxstrategy: {message}\n")
    sys.stderr.flush()
