"""The signals that tell a `PreemptionHandler` to stop: its handler installed, then what it replaced put back.

A signal only sets a flag (through `on_notice`), since it reaches Python between two bytecodes of
the main thread, wherever that is. Several handlers may be open at once, and a program may install
its own between them: they form a chain that closing them in any order keeps whole, so that once
all are closed a signal does what it did before any. docs/internals.md ("Preemption") says how.
"""

from __future__ import annotations

import signal
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

# What `signal.signal` and `signal.getsignal` give: a function, SIG_DFL or SIG_IGN, or None for a
# handler set outside Python.
SignalHandler = Callable[[int, types.FrameType | None], Any] | int | None

# The installed signals still in their chains: made, and not yet unlinked in the main thread.
# Weak, so that those nothing refers to any more (no signal, no newer handler) are not kept alive.
_linked: weakref.WeakSet[StopSignals] = weakref.WeakSet()


class StopSignals:
    """One `PreemptionHandler`'s handler of `signals`, installed (in the main thread).

    The first time each signal arrives it calls `on_notice` with the signal's name; the same
    signal a second time does what it did before (SIGINT raises `KeyboardInterrupt`; SIGTERM ends
    the process). Once `closed` is set, a signal that still reaches it is passed on to what it
    replaced.

    Args:
      signals: the signal numbers to handle.
      on_notice: called with the signal's name (such as 'SIGTERM'), in the main thread.
      closed: set when the `PreemptionHandler` closes.
      caller: how error messages name the call.

    Raises:
      ValueError: a signal cannot be handled (SIGKILL, SIGSTOP); the signals installed so far are
        put back first.
    """

    def __init__(
        self,
        signals: Sequence[int],
        *,
        on_notice: Callable[[str], None],
        closed: threading.Event,
        caller: str,
    ):
        self._on_notice = on_notice
        self._closed = closed
        self._replaced: dict[int, SignalHandler] = {}  # By signal, the handler installed before.
        self._received: set[int] = set()  # The signals received, each a notice the first time.
        _linked.add(self)
        for signum in dict.fromkeys(signals):
            try:
                self._replaced[signum] = signal.signal(signum, self.on_signal)
            except (OSError, ValueError) as error:  # SIGKILL, SIGSTOP: no handler can catch them.
                self.unlink()
                raise ValueError(
                    f"{caller}: cannot handle {signal.Signals(signum).name}: {error}."
                ) from error

    def on_signal(self, signum: int, frame: types.FrameType | None) -> None:
        """The handler installed for each signal."""
        replaced = self._replaced.get(signum)
        if self._closed.is_set():
            # Still installed though closed (in another thread, or a program's own handler
            # calls it): do what the handler it replaced does.
            _pass_on(signum, frame, replaced)
            return
        if signum in self._received:
            # The same signal twice: from now on, and now, do what it did before, such as ending
            # the process. (A polled notice, or SLURM's early SIGUSR1 then its SIGTERM, is not
            # "twice".)
            signal.signal(signum, _installable(replaced))
            _pass_on(signum, frame, replaced)
            return
        self._received.add(signum)
        self._on_notice(signal.Signals(signum).name)

    def unlink(self) -> None:
        """Take this handler out of each of its signals' chains, once (in the main thread).

        Installed, it puts back what it replaced. Replaced by a newer `StopSignals`, it hands that
        one what it replaced, so that the newer one puts that back in turn. Replaced by a handler
        of the program's own, which may call it, it stays there, passing the signal on
        (`on_signal`).
        """
        if self not in _linked:
            return
        _linked.discard(self)
        for signum, replaced in self._replaced.items():
            if signal.getsignal(signum) == self.on_signal:
                signal.signal(signum, _installable(replaced))
                continue
            for newer in list(_linked):
                if newer._replaced.get(signum) == self.on_signal:
                    newer._replaced[signum] = replaced
                    break  # A handler is replaced by one handler at most.


def _installable(replaced: SignalHandler) -> Callable[[int, types.FrameType | None], Any] | int:
    """A handler `signal.signal` accepts for `replaced`, as `signal.signal` returned it: None (a
    handler set outside Python, which Python cannot put back) becomes the default."""
    return signal.SIG_DFL if replaced is None else replaced


def _pass_on(signum: int, frame: types.FrameType | None, replaced: SignalHandler) -> None:
    """Do with the signal what `replaced`, the handler a `StopSignals` replaced, does."""
    if callable(replaced):
        replaced(signum, frame)
        return
    if replaced == signal.SIG_IGN:
        return
    # The default action (or unknown, for None): take it now. For SIGTERM or SIGINT the process
    # ends here; one whose default is to ignore it (SIGCHLD, SIGWINCH) comes back, and whatever
    # was installed goes back.
    current = signal.signal(signum, signal.SIG_DFL)
    try:
        signal.raise_signal(signum)
    finally:
        signal.signal(signum, _installable(current))
