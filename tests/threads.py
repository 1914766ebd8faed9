"""A bound on how long a test waits for a thread: a hang fails the test instead of stalling the run."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

# Seconds a producer thread may take to end; ending takes milliseconds when nothing is wrong.
THREAD_END_TIMEOUT_S = 5.0


def finishes_in_time(fn: Callable[[], Any], timeout_s: float = THREAD_END_TIMEOUT_S) -> bool:
    """Run `fn` in a daemon thread and re-raise its error; False if it is still running after `timeout_s`."""
    errors = []

    def target() -> None:
        try:
            fn()
        except BaseException as error:  # noqa: B036  Re-raised in the test's thread below.
            errors.append(error)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if errors:
        raise errors[0]
    return not thread.is_alive()
