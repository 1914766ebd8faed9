"""`InFlightLimit`: every n-th step waited for, one thread at a time."""

from __future__ import annotations

import threading

import pytest

from jaxstrategy._src.steps import in_flight
from jaxstrategy._src.steps.in_flight import InFlightLimit

THREAD_TIMEOUT_S = 10


@pytest.fixture
def waited(monkeypatch):
    """What the limit waited for, in order, instead of waiting."""
    calls: list[object] = []
    monkeypatch.setattr(in_flight.jax, "block_until_ready", calls.append)
    return calls


def test_every_nth_call_is_waited_for(waited):
    limited = InFlightLimit(wait_every=3).wrap(lambda i: ("out", i + 100))
    for i in range(7):
        assert limited(i) == ("out", i + 100)
    # One output of each waited call, the last: one program makes them all at once.
    assert waited == [102, 105]


def test_the_output_waited_for_is_one_the_program_made_not_an_input_handed_back(waited):
    made, given = object(), object()
    limited = InFlightLimit(wait_every=1).wrap(lambda state, extra: (made, state))
    limited(given, 1)
    handed_back = InFlightLimit(wait_every=1).wrap(lambda state: {"state": state})
    handed_back(given)
    assert waited == [made, None]  # Nothing made: nothing to wait for.


def test_calls_wrapped_apart_are_counted_together(waited):
    limit = InFlightLimit(wait_every=4)
    first, second = limit.wrap(lambda: "first"), limit.wrap(lambda: "second")
    for call in (first, second) * 4:
        call()
    assert waited == ["second", "second"]  # 8 calls through one limit: one wait per 4.


def test_one_thread_at_a_time_dispatches(waited):
    inside, release = threading.Event(), threading.Event()

    def slow_dispatch():
        inside.set()
        assert release.wait(THREAD_TIMEOUT_S)
        return "slow"

    entered_second: list[str] = []
    limit = InFlightLimit(wait_every=100)
    slow, fast = limit.wrap(slow_dispatch), limit.wrap(lambda: entered_second.append("fast"))
    first = threading.Thread(target=slow, daemon=True)
    first.start()
    assert inside.wait(THREAD_TIMEOUT_S)
    second = threading.Thread(target=fast, daemon=True)
    second.start()
    second.join(timeout=0.2)
    assert second.is_alive() and entered_second == []  # Waiting for the first to dispatch.
    release.set()
    first.join(timeout=THREAD_TIMEOUT_S)
    second.join(timeout=THREAD_TIMEOUT_S)
    assert not first.is_alive() and not second.is_alive()
    assert entered_second == ["fast"]


def test_errors_pass_through_uncounted_and_release_the_lock(waited):
    def fail():
        raise RuntimeError("boom")

    limit = InFlightLimit(wait_every=1)
    with pytest.raises(RuntimeError, match="boom"):
        limit.wrap(fail)()
    assert waited == []
    other = threading.Thread(target=limit.wrap(lambda: 1), daemon=True)
    other.start()
    other.join(timeout=THREAD_TIMEOUT_S)
    assert not other.is_alive() and waited == [1]
