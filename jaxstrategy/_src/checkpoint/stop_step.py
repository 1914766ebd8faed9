"""How the processes of a job agree on the step at which all of them save and stop.

Asynchronous dispatch lets each process's Python run a few steps ahead of the others, so a
process told to stop cannot simply stop where it is. It posts a request in JAX's coordination
service; a watcher thread in every process answers with how many steps its process has started;
all stop at the largest, which none has passed. docs/internals.md ("Preemption") says why the
watchers, not the loops, answer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from jaxstrategy._src.cluster.coordination import KeyValueStore

# How often a watcher waiting for the coordination service checks whether it should end; it
# ends within this when the loop does.
POLL_MS = 250


class StopStepAgreement:
    """One process's part in agreeing on the stopping step, under the key prefix `namespace`.

    The loop's thread calls `request` once told to stop, and `at_boundary` before each step; a
    thread runs `watch`; `announce` publishes the final count when the loop ends without a stop,
    so that a request that comes too late has everyone finish normally.

    Args:
      namespace: the key prefix, the same on every process (`coordination.new_namespace`).
      steps_started: how many steps this process's loop has started.
      process: this process's index.
      num_processes: how many processes the job has.
      timeout_s: how long the loop waits for the others to agree before `TimeoutError`.
      closed: set when the handler closes; the watcher then ends.
    """

    def __init__(
        self,
        namespace: str,
        *,
        steps_started: Callable[[], int],
        process: int,
        num_processes: int,
        timeout_s: float,
        closed: threading.Event,
    ):
        self.namespace = namespace
        self._steps_started = steps_started
        self._process, self._num_processes = process, num_processes
        self._timeout_s = timeout_s
        self._closed = closed
        self._store = KeyValueStore()
        # Guards what follows, and the loop's count of steps started (see `at_boundary`).
        self._agreeing = threading.Condition()
        self._announced: int | None = None  # What this process published.
        self._stop_at: int | None = None  # The step agreed on.
        self._watch_error: BaseException | None = None
        self._requested = False

    def _key(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def request(self) -> None:
        """Ask every process to agree on a step to stop at (once; another process may have asked)."""
        if not self._requested:
            self._requested = True
            self._store.set_once(self._key("request"), str(self._process))

    @contextlib.contextmanager
    def at_boundary(self) -> Iterator[int | None]:
        """At a step boundary of the loop: wait, once this process has published how far it is or
        asked, until the stopping step is known; give it (None while no process has asked).

        Nothing is published while the block runs, so a step the loop counts as started inside it
        is counted in what this process publishes.

        Raises:
          TimeoutError: the processes did not agree within `timeout_s`.
          RuntimeError: the watcher failed (the coordination service is gone, say).
        """
        deadline = time.monotonic() + self._timeout_s
        with self._agreeing:
            # Once this process published how far it is, it starts no step before the stop is known.
            while (
                self._watch_error is None
                and self._stop_at is None
                and (self._announced is not None or self._requested)
            ):
                if not self._agreeing.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(
                        f"PreemptionHandler: process {self._process} waited {self._timeout_s:g} s "
                        "for the other processes to agree on the step to stop at. Every process must "
                        "create the same PreemptionHandlers and run their steps."
                    )
            if self._watch_error is not None:
                raise RuntimeError(f"PreemptionHandler: watching for preemption failed: {self._watch_error}")
            yield self._stop_at

    def announce(self) -> None:
        """Publish how many steps this process has started, once; it starts no more until the
        stopping step is known."""
        with self._agreeing:
            if self._announced is not None:
                return
            self._announced = self._steps_started()
        self._store.set(self._key(f"position/{self._process}"), str(self._announced))

    def watch(self) -> None:
        """The watcher thread: wait for a request, publish this process's count, and read every
        process's, until the handler closes."""
        try:
            if self._wait_for(self._key("request")) is None:
                return
            self.announce()
            deadline = time.monotonic() + self._timeout_s
            positions = []
            for process in range(self._num_processes):
                value = self._wait_for(self._key(f"position/{process}"), deadline)
                if value is None:
                    return
                positions.append(int(value))
            with self._agreeing:
                self._stop_at = max(positions)
                self._agreeing.notify_all()
        except Exception as error:
            if self._closed.is_set():
                return  # The job is ending; its service may be gone.
            with self._agreeing:
                self._watch_error = error
                self._agreeing.notify_all()

    def _wait_for(self, key: str, deadline: float | None = None) -> str | None:
        """The value of `key` once set; None when the handler closes, or at `deadline`."""
        # At the deadline the loop's thread reports the timeout.
        return self._store.wait_for(key, deadline=deadline, stop=self._closed, poll_ms=POLL_MS)
