"""Preemption: on a termination signal, finish the step, save everything, and end the program.

`PreemptionHandler.steps` numbers a training loop's steps; before each one it checks whether the
loop must stop. A signal handler (SIGTERM by default) or a polled termination notice only sets a
flag, since a signal reaches Python between two bytecodes of the main thread, wherever that is.

One process alone stops at the first step boundary after the flag is set. The processes of a
job must stop at the same step, and save together, though JAX's asynchronous dispatch lets each
one's Python run a few steps ahead of the others, so they agree through JAX's coordination
service (its key-value store, through `cluster/coordination.py`):

- the process that got the signal, at its next step boundary, posts a request;
- in every process a watcher thread waits for that request; when it comes, the watcher takes
  the number of steps its main thread has started and publishes it; from then on the main
  thread starts no further step until the stopping step is known;
- each watcher reads every process's number; the stopping step is the largest, which no
  process has passed; every process goes on to it, saves, and ends.

The watchers, not the main threads, publish the numbers, so a main thread that is waiting inside
a step for the others (reading a loss, say) holds nobody up: the processes that stopped first
resume once the step is known, which lets the waiting one finish its step. A process whose loop
ends publishes its final number, so a request that comes too late makes everyone finish
normally instead of waiting for it.

Several handlers may be alive at once (a loop per phase, say, each made before the first runs),
and a program may install its own signal handlers between them. Each handler replaced one
before it and remembers it, so the handlers form a chain; closing one takes it out of the chain
(see `_unlink`), and a closed handler that still gets a signal passes it on (`_pass_on`), so in
whatever order they close, an open handler keeps getting its signal and, once all are closed,
the signal does what it did before any.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax

from jaxstrategy._src.checkpoint.checkpointer import Checkpointer
from jaxstrategy._src.cluster.coordination import KeyValueStore, new_namespace
from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.device_spec import spans_processes
from jaxstrategy._src.core.errors import caller_stacklevel
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.strategies.strategy import Strategy, get_strategy

# The exit status of a program that stopped and saved because it was preempted, so that a
# launcher can tell it from a failure and start it again (TensorFlow's handler uses 42 too).
PREEMPTED_EXIT_CODE = 42

_LOGGER = logging.getLogger("jaxstrategy")
# How often a watcher waiting for the coordination service checks whether it should end; it
# ends within this when the loop does.
_POLL_MS = 250
_NOTICE_POLL_S = 1.0

_SignalHandler = Callable[[int, types.FrameType | None], Any] | int | None

# The handlers still in their signals' chains: made, and not yet closed in the main thread. Weak,
# so that a handler nothing refers to any more (no signal, no other handler) is not kept alive.
_linked: weakref.WeakSet[PreemptionHandler] = weakref.WeakSet()


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
        self._timeout_s = float(timeout_s)
        self._step = 0
        self._preempted = False
        self._cause: str | None = None  # What told this process to stop.
        # The first error termination_notice raised, and whether the loop has warned of it.
        self._notice_error: Exception | None = None
        self._notice_error_reported = False
        self._notice = threading.Event()
        self._signalled: set[int] = set()  # The signals received, each a notice the first time.
        self._closed = threading.Event()
        self._cond = threading.Condition()
        # Several processes: what this process published, the step agreed on, a watcher's failure.
        self._announced: int | None = None
        self._stop_at: int | None = None
        self._error: BaseException | None = None
        self._requested = False
        self._process, self._num_processes = jax.process_index(), jax.process_count()
        self._multi_process = spans_processes(self._strategy.devices)
        self._namespace = new_namespace("preemption")
        self._previous: dict[int, _SignalHandler] = {}
        self._threads: list[threading.Thread] = []
        _linked.add(self)
        for signum in dict.fromkeys(signals):
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except (OSError, ValueError) as error:  # SIGKILL, SIGSTOP: no handler can catch them.
                self.close()
                raise ValueError(
                    f"{caller}: cannot handle {signal.Signals(signum).name}: {error}."
                ) from error
        if self._multi_process:
            self._store = KeyValueStore()
            # Before JAX's own shutdown (registered earlier): no watcher may be inside a call then.
            atexit.register(self.close)
            self._threads.append(
                threading.Thread(target=self._watch, name="jaxstrategy-preemption", daemon=True)
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
            # later close() here, or at exit; meanwhile `_on_signal` passes signals on.
            atexit.unregister(self.close)
            self._unlink()
        for thread in self._threads:
            if thread is not threading.current_thread():
                # Within a poll: a watcher must not be inside a call when JAX's client shuts down.
                thread.join(timeout=2 * _POLL_MS / 1000)

    def __enter__(self) -> PreemptionHandler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- signals and notices -------------------------------------------------------------------

    def _unlink(self) -> None:
        """Take this handler out of each of its signals' chains, once (in the main thread).

        Installed, it puts back what it replaced. Replaced by a newer handler of this class, it
        hands that one what it replaced, so that the newer one puts that back in turn. Replaced
        by a handler of the program's own, which may call it, it stays there, passing the
        signal on (`_on_signal`).
        """
        if self not in _linked:
            return
        _linked.discard(self)
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, _installable(previous))
                continue
            for newer in list(_linked):
                if newer._previous.get(signum) == self._on_signal:
                    newer._previous[signum] = previous
                    break  # A handler is replaced by one handler at most.

    def _on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        previous = self._previous.get(signum)
        if self._closed.is_set():
            # Still installed though closed (in another thread, or a program's own handler
            # calls it): do what the handler it replaced does.
            _pass_on(signum, frame, previous)
            return
        if signum in self._signalled:
            # The same signal twice: from now on, and now, do what it did before, such as ending
            # the process. (A polled notice, or SLURM's early SIGUSR1 then its SIGTERM, is not
            # "twice".)
            signal.signal(signum, _installable(previous))
            _pass_on(signum, frame, previous)
            return
        self._signalled.add(signum)
        self._cause = self._cause or signal.Signals(signum).name
        self._notice.set()

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
                self._cause = self._cause or "a termination notice"
                self._notice.set()
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
        if not self._multi_process:
            if self._notice.is_set():
                return True
            self._step += 1
            return False
        if self._notice.is_set() and not self._requested:
            self._requested = True
            self._request()
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            # Once this process published how far it is, it starts no step before the stop is known.
            while (
                self._error is None
                and self._stop_at is None
                and (self._announced is not None or self._requested)
            ):
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(
                        f"PreemptionHandler: process {self._process} waited {self._timeout_s:g} s "
                        "for the other processes to agree on the step to stop at. Every process must "
                        "create the same PreemptionHandlers and run their steps."
                    )
            if self._error is not None:
                raise RuntimeError(f"PreemptionHandler: watching for preemption failed: {self._error}")
            if self._stop_at is not None and self._step >= self._stop_at:
                return True
            self._step += 1
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
        if self._multi_process and not self._closed.is_set():
            self._announce()
        self.close()

    # --- agreeing across processes -----------------------------------------------------------------

    def _key(self, name: str) -> str:
        return f"{self._namespace}/{name}"

    def _request(self) -> None:
        self._store.set_once(self._key("request"), str(self._process))  # Or another asked first.

    def _announce(self) -> None:
        """Publish how many steps this process has started, once; it starts no more until the
        stopping step is known."""
        with self._cond:
            if self._announced is not None:
                return
            self._announced = self._step
        self._store.set(self._key(f"position/{self._process}"), str(self._announced))

    def _watch(self) -> None:
        try:
            if self._wait_for(self._key("request")) is None:
                return
            self._announce()
            deadline = time.monotonic() + self._timeout_s
            positions = []
            for process in range(self._num_processes):
                value = self._wait_for(self._key(f"position/{process}"), deadline)
                if value is None:
                    return
                positions.append(int(value))
            with self._cond:
                self._stop_at = max(positions)
                self._cond.notify_all()
        except Exception as error:
            if self._closed.is_set():
                return  # The job is ending; its service may be gone.
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _wait_for(self, key: str, deadline: float | None = None) -> str | None:
        """The value of `key` once set; None when the handler closes, or at `deadline`."""
        # At the deadline the main thread reports the timeout.
        return self._store.wait_for(key, deadline=deadline, stop=self._closed, poll_ms=_POLL_MS)


def _installable(previous: _SignalHandler) -> Callable[[int, types.FrameType | None], Any] | int:
    """A handler `signal.signal` accepts for `previous`, as `signal.signal` returned it: None (a
    handler set outside Python, which Python cannot put back) becomes the default."""
    return signal.SIG_DFL if previous is None else previous


def _pass_on(signum: int, frame: types.FrameType | None, previous: _SignalHandler) -> None:
    """Do with the signal what `previous`, the handler a PreemptionHandler replaced, does."""
    if callable(previous):
        previous(signum, frame)
        return
    if previous == signal.SIG_IGN:
        return
    # The default action (or unknown, for None): take it now. For SIGTERM or SIGINT the process
    # ends here; one whose default is to ignore it (SIGCHLD, SIGWINCH) comes back, and whatever
    # was installed goes back.
    current = signal.signal(signum, signal.SIG_DFL)
    try:
        signal.raise_signal(signum)
    finally:
        signal.signal(signum, _installable(current))
