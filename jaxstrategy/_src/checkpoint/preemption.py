"""`PreemptionHandler`: on a termination signal or notice, finish the step, save everything, and end.

The handler numbers a training loop's steps and checks before each one whether the job was told
to stop: by a signal (`stop_signals.py`) or a polled notice. One process stops at the next step
boundary; the processes of a job first agree on a common step (`stop_step.py`). Then each saves
with its `Checkpointer`, logs a line, and exits with `PREEMPTED_EXIT_CODE`.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence

import jax

from jaxstrategy._src.checkpoint.checkpointer import Checkpointer
from jaxstrategy._src.checkpoint.stop_signals import StopSignals
from jaxstrategy._src.checkpoint.stop_step import POLL_MS, StopStepAgreement
from jaxstrategy._src.cluster.coordination import new_namespace
from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.device_spec import spans_processes
from jaxstrategy._src.core.errors import caller_stacklevel
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.strategies.strategy import Strategy, get_strategy

# The exit status of a program that stopped and saved because it was preempted, so that a
# launcher can tell it from a failure and start it again (TensorFlow's handler uses 42 too).
PREEMPTED_EXIT_CODE = 42

_LOGGER = logging.getLogger("jaxstrategy")
# How often `termination_notice` is called.
_NOTICE_POLL_S = 1.0


class PreemptionHandler:
    """Ends a training loop cleanly when the job is told to stop, after saving everything.

    `steps(stop, state)` numbers the loop's steps. When one of `signals` arrives (SIGTERM, which
    Kubernetes and SLURM send before they kill a job), or `termination_notice()` returns True,
    the step that is running finishes; every process of the job agrees on the step to stop at,
    through JAX's coordination service; each one saves `state()` there with `checkpointer` (the
    arrays, and each `DistributedIterator`'s position), writes a log line saying so, and ends
    with `SystemExit(exit_code)`. Run the same program again: `restore(target)` brings back the
    variables, the optimizer state and the iterators' positions, and `steps` goes on from the
    saved step, so the run continues exactly where it stopped.

    The same signal a second time does what it did before (SIGINT raises
    `KeyboardInterrupt`; SIGTERM ends the process). `close()` (or leaving a `with` block, or the
    end of `steps`) puts the previous signal handlers back. Several handlers may be open at
    once: the newest one open gets the signal, and once all are closed, in any order, the signal
    does what it did before any. Like `signal.signal`, it must be created in the main thread.

    SLURM sends SIGTERM only when it kills the job; `sbatch --signal=B:USR1@120` sends a signal
    120 s ahead, so pass `signals=(signal.SIGUSR1, signal.SIGTERM)` to save in time. A notice
    that comes otherwise (a file, a metadata server) can be polled, once a second, through
    `termination_notice`.

    Args:
      checkpointer: where to save; every process of a job passes one of the same directory.
      strategy: the strategy to restore onto (the current one when None); its devices tell
        whether the job has several processes, which then agree on the step.
      signals: the signals that mean the job must stop.
      exit_code: the status to end with (`SystemExit`) once saved; None ends the loop instead,
        with `preempted` True.
      termination_notice: a function, polled once a second in a thread, that returns True once
        the job must stop. When it raises, it is polled again a second later, and the first
        error is reported as a `RuntimeWarning` at the loop's next step.
      timeout_s: how long a process waits for the others to agree on the step before raising
        `TimeoutError`.

    Raises:
      TypeError: `checkpointer` is not a `Checkpointer`, or `termination_notice` is not callable.
      ValueError: created outside the main thread, or a signal is not a signal number.

    Example:
      >>> import os, signal, tempfile, jax.numpy as jnp, jaxstrategy
      >>> from jaxstrategy import checkpoint
      >>> checkpointer = checkpoint.Checkpointer(tempfile.mkdtemp())
      >>> handler = checkpoint.PreemptionHandler(checkpointer, exit_code=None)
      >>> w = handler.restore({'w': jnp.zeros(())})['w']   # a fresh start: the target itself
      >>> for step in handler.steps(10, lambda: {'w': w}):
      ...     w = w + 1
      ...     if step == 3:
      ...         os.kill(os.getpid(), signal.SIGTERM)   # as the cluster would
      >>> handler.preempted, checkpointer.latest_step(), float(w)
      (True, 4, 4.0)
      >>> again = checkpoint.PreemptionHandler(checkpointer, exit_code=None)   # the next run
      >>> w = again.restore({'w': jnp.zeros(())})['w']
      >>> again.step, [step for step in again.steps(6, lambda: {'w': w})]
      (4, [4, 5])
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        strategy: Strategy | None = None,
        *,
        signals: Sequence[int] = (signal.SIGTERM,),
        exit_code: int | None = PREEMPTED_EXIT_CODE,
        termination_notice: Callable[[], bool] | None = None,
        timeout_s: float = 300.0,
    ):
        caller = "PreemptionHandler()"
        if not isinstance(checkpointer, Checkpointer):
            raise TypeError(
                f"{caller}: checkpointer must be a jaxstrategy.checkpoint.Checkpointer; got "
                f"{type(checkpointer).__name__}."
            )
        if termination_notice is not None and not callable(termination_notice):
            raise TypeError(f"{caller}: termination_notice must be a function returning a bool, or None.")
        valid = set(signal.valid_signals())
        bad = [s for s in signals if not is_int(s) or s not in valid]
        if isinstance(signals, str | bytes) or bad:
            raise ValueError(
                f"{caller}: signals must be signal numbers such as signal.SIGTERM; got {signals!r}."
            )
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                f"{caller}: must be created in the main thread, since only the main thread can "
                "handle signals (as with signal.signal)."
            )
        self._checkpointer = checkpointer
        self._strategy = get_strategy() if strategy is None else strategy
        self._exit_code = exit_code
        self._step = 0
        self._preempted = False
        self._cause: str | None = None  # What told this process to stop.
        # The first error termination_notice raised, and whether the loop has warned of it.
        self._notice_error: Exception | None = None
        self._notice_error_reported = False
        self._told_to_stop = threading.Event()
        self._closed = threading.Event()
        self._process, self._num_processes = jax.process_index(), jax.process_count()
        self._multi_process = spans_processes(self._strategy.devices)
        namespace = new_namespace("preemption")
        self._threads: list[threading.Thread] = []
        self._signals = StopSignals(
            signals, on_notice=self._on_stop_notice, closed=self._closed, caller=caller
        )
        # Several processes: the agreement on the step to stop at.
        self._agreement: StopStepAgreement | None = None
        if self._multi_process:
            self._agreement = StopStepAgreement(
                namespace,
                steps_started=lambda: self._step,
                process=self._process,
                num_processes=self._num_processes,
                timeout_s=float(timeout_s),
                closed=self._closed,
            )
            # Before JAX's own shutdown (registered earlier): no watcher may be inside a call then.
            atexit.register(self.close)
            self._threads.append(
                threading.Thread(target=self._agreement.watch, name="jaxstrategy-preemption", daemon=True)
            )
        if termination_notice is not None:
            self._threads.append(
                threading.Thread(
                    target=self._poll_notice,
                    args=(termination_notice,),
                    name="jaxstrategy-notice",
                    daemon=True,
                )
            )
        for thread in self._threads:
            thread.start()

    @property
    def step(self) -> int:
        """The number of steps done: the restored step, then one more for each step started."""
        return self._step

    @property
    def preempted(self) -> bool:
        """Whether the loop stopped (and saved) because the job was told to stop."""
        return self._preempted

    def restore(self, target: PyTree) -> PyTree:
        """Restore the newest checkpoint into `target`'s structure, or return `target` when none.

        `target` is the tree `steps` saves: arrays (or NNX objects, restored in place), and
        `DistributedIterator`s, which are set to their saved positions in place. `step` becomes
        the checkpoint's step (0 without one), where `steps` goes on.

        Raises:
          CheckpointMismatchError: `target` differs from the checkpoint (see
            `Checkpointer.restore`).
        """
        latest = self._checkpointer.latest_step()
        if latest is None:
            return target
        restored = self._checkpointer.restore(latest, strategy=self._strategy, target=target)
        self._step = latest
        _LOGGER.info("PreemptionHandler: resumed at step %d from %s", latest, self._checkpointer.directory)
        return restored

    def steps(self, stop: int, state: Callable[[], PyTree]) -> Iterator[int]:
        """Yield the step numbers from `step` up to `stop` (excluded), stopping early, after
        saving `state()`, when the job is told to stop.

        Before each step it checks for a signal or notice. Then every process agrees on the step
        to stop at, saves `state()` as that step with the checkpointer (waiting until it is on
        disk), logs a line (`logging`, WARNING), and raises `SystemExit(exit_code)`, or with
        `exit_code=None` ends the loop. Take the step's batch inside the loop
        (`next(iterator)`), so that a saved iterator has not taken a batch no step used.

        Args:
          stop: the number of steps of the whole run.
          state: a function returning the tree to save, such as `lambda: {'params': params,
            'opt_state': opt_state, 'data': iterator}`: a function, so that it sees the newest
            values.

        Raises:
          TypeError: `state` is not callable.
          TimeoutError: the processes did not agree on the step within `timeout_s`.
        """
        if self._closed.is_set():
            raise RuntimeError(
                "PreemptionHandler.steps(): this handler is closed (its loop ended, or close() was "
                "called): it no longer handles signals. Create a new PreemptionHandler for a new loop."
            )
        if not callable(state):
            raise TypeError(
                "PreemptionHandler.steps(): state must be a function returning the tree to save, "
                "such as lambda: {'params': params, 'data': iterator}, so that it sees the newest "
                f"values; got a {type(state).__name__}."
            )
        try:
            while (step := self._step) < stop:
                if self._must_stop():
                    self._save_and_stop(state)
                    return
                yield step  # `_must_stop` counted it as started.
        finally:
            self._finish()

    def close(self) -> None:
        """Put the previous signal handlers back and stop the handler's threads. Safe to call twice.

        With several handlers open, closing one that another replaced leaves that other one
        getting the signal, and hands it, for when it closes, what this one had replaced.
        """
        self._closed.set()
        if threading.current_thread() is threading.main_thread():
            # Only the main thread may set handlers: closed elsewhere, they are put back by a
            # later close() here, or at exit; meanwhile `StopSignals.on_signal` passes signals on.
            atexit.unregister(self.close)
            self._signals.unlink()
        for thread in self._threads:
            if thread is not threading.current_thread():
                # Within a poll: a watcher must not be inside a call when JAX's client shuts down.
                thread.join(timeout=2 * POLL_MS / 1000)

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- signals and notices -------------------------------------------------------------------

    def _on_stop_notice(self, cause: str) -> None:
        """The job was told to stop, by `cause` (a signal's name, or a notice)."""
        self._cause = self._cause or cause
        self._told_to_stop.set()

    def _poll_notice(self, termination_notice: Callable[[], bool]) -> None:
        while not self._closed.wait(_NOTICE_POLL_S):
            try:
                stop = termination_notice()
            except Exception as error:
                # A notice read over a network (a metadata server) fails now and then: one
                # failure must not turn preemption off for the rest of the run. The loop's
                # thread warns of it (`_warn_of_notice_error`): a warning here would not reach
                # the program, and one turned into an error would end this thread.
                if self._notice_error is None:
                    self._notice_error = error
                continue
            if stop:
                self._on_stop_notice("a termination notice")
                return

    def _warn_of_notice_error(self) -> None:
        """Warn, once, of the first error termination_notice raised; called at a step boundary."""
        error = self._notice_error
        if error is None or self._notice_error_reported:
            return
        self._notice_error_reported = True
        warnings.warn(
            f"PreemptionHandler: termination_notice raised {type(error).__name__}: {error}. It is "
            f"called again every {_NOTICE_POLL_S:g} s, and stops the loop once it returns True; only "
            "this first failure is reported. Catch errors inside termination_notice (returning "
            "False, say) to handle them otherwise.",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),  # The loop over `steps`.
        )

    # --- the step boundary -----------------------------------------------------------------------

    def _must_stop(self) -> bool:
        """Whether to stop before step `self._step`; else count it as started."""
        self._warn_of_notice_error()
        if self._agreement is None:
            if self._told_to_stop.is_set():
                return True
            self._step += 1
            return False
        if self._told_to_stop.is_set():
            self._agreement.request()
        with self._agreement.at_boundary() as stop_at:
            if stop_at is not None and self._step >= stop_at:
                return True
            self._step += 1  # Inside the boundary: counted in what this process publishes.
            return False

    def _save_and_stop(self, state: Callable[[], PyTree]) -> None:
        started = time.perf_counter()
        step = self._step
        checkpointer = self._checkpointer
        checkpointer.wait()  # A save of this step in flight lists it once done.
        if step in checkpointer.all_steps():
            saved = f"step {step} was saved already in {checkpointer.directory}"
        else:
            checkpointer.save(step, state(), force=True)
            checkpointer.wait()
            saved = f"saved step {step} to {checkpointer.directory} in {time.perf_counter() - started:.2f} s"
        self._preempted = True
        cause = self._cause if self._cause is not None else "another process's signal"
        where = f" (process {self._process} of {self._num_processes})" if self._multi_process else ""
        ending = "ending the loop" if self._exit_code is None else f"exiting with status {self._exit_code}"
        _LOGGER.warning(
            "PreemptionHandler: preempted by %s%s: %s; %s. Run the program again to resume at step %d.",
            cause,
            where,
            saved,
            ending,
            step,
        )
        self._finish()
        if self._exit_code is not None:
            raise SystemExit(self._exit_code)

    def _finish(self) -> None:
        """The loop is over: publish the final step for a late request, and stop the threads."""
        if self._agreement is not None and not self._closed.is_set():
            self._agreement.announce()
        self.close()
