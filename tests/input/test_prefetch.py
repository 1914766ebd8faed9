"""The prefetch iterator's lifetime rules: every thread ends, errors arrive on time, memory is bounded."""

from __future__ import annotations

import gc
import threading
import time
import traceback

import pytest
from threads import THREAD_END_TIMEOUT_S, finishes_in_time

from jaxstrategy._src.input.prefetch import PrefetchIterator


def _wait_until_ended(thread: threading.Thread) -> None:
    thread.join(timeout=THREAD_END_TIMEOUT_S)
    assert not thread.is_alive(), "the prefetch thread did not end"


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jaxstrategy-prefetch"]


def test_yields_put_of_every_element_in_order():
    assert list(PrefetchIterator(iter(range(100)), put=lambda x: -x, buffer_size=2)) == [
        -x for x in range(100)
    ]


def test_buffer_size_zero_uses_no_thread():
    before = set(threading.enumerate())  # Not a count: threads of other tests may end meanwhile.
    iterator = PrefetchIterator(iter([1, 2]), put=str, buffer_size=0)
    assert iterator.thread is None and set(threading.enumerate()) - before == set()
    assert list(iterator) == ["1", "2"]


@pytest.mark.parametrize("buffer_size", [0, 1, 2])
def test_a_source_error_arrives_at_its_step_with_its_traceback(buffer_size):
    def source():
        yield 1
        yield 2
        raise KeyError("record 3 is corrupt")

    iterator = PrefetchIterator(source(), put=lambda x: x, buffer_size=buffer_size)
    assert next(iterator) == 1
    assert next(iterator) == 2
    with pytest.raises(KeyError, match="record 3 is corrupt") as info:
        next(iterator)
    assert "in source" in "".join(traceback.format_tb(info.value.__traceback__))
    with pytest.raises(StopIteration):
        next(iterator)  # The pass is over after an error.


def test_an_error_from_put_arrives_too():
    def put(x):
        if x == 1:
            raise ValueError("cannot place element 1")
        return x

    iterator = PrefetchIterator(iter([0, 1, 2]), put=put, buffer_size=2)
    assert next(iterator) == 0
    with pytest.raises(ValueError, match="cannot place element 1"):
        next(iterator)


def test_a_failing_put_closes_the_generator():
    cleaned_up = threading.Event()

    def source():
        try:
            yield from range(100)
        finally:
            cleaned_up.set()

    def put(x):
        if x == 2:
            raise ValueError("bad element")
        return x

    iterator = PrefetchIterator(source(), put=put, buffer_size=2)
    with pytest.raises(ValueError, match="bad element"):
        list(iterator)
    assert cleaned_up.wait(THREAD_END_TIMEOUT_S)


def test_the_thread_ends_with_the_source():
    iterator = PrefetchIterator(iter([1, 2, 3]), put=lambda x: x, buffer_size=2)
    assert list(iterator) == [1, 2, 3]
    _wait_until_ended(iterator.thread)


def test_close_ends_the_thread_and_runs_the_generators_finally_block():
    cleaned_up = threading.Event()

    def endless():
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            cleaned_up.set()

    iterator = PrefetchIterator(endless(), put=lambda x: x, buffer_size=2)
    assert next(iterator) == 0
    iterator.close()
    _wait_until_ended(iterator.thread)
    assert cleaned_up.wait(THREAD_END_TIMEOUT_S)
    with pytest.raises(StopIteration):
        next(iterator)
    iterator.close()  # A second close is harmless.


def test_breaking_out_of_a_loop_ends_the_thread():
    before = set(_prefetch_threads())
    started = set()

    def loop_and_break():
        for i in PrefetchIterator(iter(range(10**9)), put=lambda x: x, buffer_size=2):
            if i == 3:
                started.update(set(_prefetch_threads()) - before)  # Alive mid-loop, so seen here.
                break

    loop_and_break()
    gc.collect()
    assert len(started) == 1, "the loop's prefetch thread was not seen"
    for thread in started:
        _wait_until_ended(thread)


def test_garbage_collection_ends_the_thread():
    iterator = PrefetchIterator(iter(range(10**9)), put=lambda x: x, buffer_size=2)
    next(iterator)
    thread = iterator.thread
    del iterator
    gc.collect()
    _wait_until_ended(thread)


def test_keyboard_interrupt_in_the_consumer_ends_the_thread():
    iterator = PrefetchIterator(iter(range(10**9)), put=lambda x: x, buffer_size=2)
    thread = iterator.thread
    with pytest.raises(KeyboardInterrupt):
        for i in iterator:
            if i == 5:
                raise KeyboardInterrupt
    del iterator
    gc.collect()
    _wait_until_ended(thread)


def test_a_thousand_abandoned_passes_leave_no_thread():
    before = set(_prefetch_threads())
    for _ in range(1000):
        iterator = PrefetchIterator(iter(range(10)), put=lambda x: x, buffer_size=2)
        next(iterator)
        del iterator
    gc.collect()
    for thread in set(_prefetch_threads()) - before:
        _wait_until_ended(thread)


def test_at_most_buffer_size_elements_are_placed_ahead():
    placed = []

    def put(x):
        placed.append(x)
        return x

    iterator = PrefetchIterator(iter(range(100)), put=put, buffer_size=3)
    assert next(iterator) == 0
    deadline = time.monotonic() + THREAD_END_TIMEOUT_S
    while len(placed) < 4 and time.monotonic() < deadline:  # Let the producer fill the buffer.
        time.sleep(0.01)
    time.sleep(0.2)  # Then give it the chance to overrun.
    assert len(placed) == 1 + 3, "the consumed element plus three placed ahead"
    iterator.close()


def test_peek_does_not_consume():
    iterator = PrefetchIterator(iter([7, 8]), put=lambda x: x, buffer_size=1)
    assert iterator.peek() == 7 and iterator.peek() == 7
    assert list(iterator) == [7, 8]
    with pytest.raises(StopIteration):
        iterator.peek()


@pytest.mark.parametrize("buffer_size", [2, 10**12], ids=["small", "huge"])
def test_closing_takes_no_time_proportional_to_the_buffer_size(buffer_size):
    # Releasing a slot per buffer entry at close took 18 s at 10**7; 10**12 would take days.
    def whole_pass():
        iterator = PrefetchIterator(iter(range(3)), put=lambda x: x, buffer_size=buffer_size)
        assert list(iterator) == [0, 1, 2]
        iterator.close()
        _wait_until_ended(iterator.thread)

    def closed_mid_pass():
        iterator = PrefetchIterator(iter(range(10**9)), put=lambda x: x, buffer_size=buffer_size)
        assert next(iterator) == 0
        iterator.close()
        _wait_until_ended(iterator.thread)

    assert finishes_in_time(whole_pass), "a pass did not end and close in time"
    assert finishes_in_time(closed_mid_pass), "closing mid-pass did not end in time"


def _drain_from_threads(iterator, num_threads, take):
    """Drain `iterator` from `num_threads` threads at once with `take(iterator)`.

    Returns the elements each thread took, and the exception each ended with.
    """
    taken = [[] for _ in range(num_threads)]
    ended_with: list[BaseException | None] = [None] * num_threads
    start = threading.Barrier(num_threads)

    def drain(i):
        start.wait()
        try:
            while True:
                taken[i].append(take(iterator))
        except BaseException as error:  # noqa: B036  Checked by the test.
            ended_with[i] = error

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_END_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a consumer thread did not finish"
    return taken, ended_with


@pytest.mark.parametrize("buffer_size", [0, 1, 2])
def test_threads_sharing_one_iterator_each_take_different_elements_and_all_see_the_end(buffer_size):
    source = (x for x in range(200))  # A generator: reading it from two threads at once is an error.
    iterator = PrefetchIterator(source, put=lambda x: x, buffer_size=buffer_size)
    taken, ended_with = _drain_from_threads(iterator, 4, next)
    assert all(isinstance(error, StopIteration) for error in ended_with), ended_with
    assert sorted(x for mine in taken for x in mine) == list(range(200)), "every element exactly once"
    if iterator.thread is not None:
        _wait_until_ended(iterator.thread)


def test_close_from_another_thread_ends_a_waiting_next():
    release_source = threading.Event()

    def source():
        yield 0
        release_source.wait(THREAD_END_TIMEOUT_S)  # Nothing arrives while the consumer waits.
        yield 1

    iterator = PrefetchIterator(source(), put=lambda x: x, buffer_size=2)
    assert next(iterator) == 0
    waiter_ended_with = []

    def wait_for_next():
        try:
            next(iterator)
        except BaseException as error:  # noqa: B036  Checked below.
            waiter_ended_with.append(error)

    waiter = threading.Thread(target=wait_for_next, daemon=True)
    waiter.start()
    time.sleep(0.1)  # Let it wait for an element.
    iterator.close()
    waiter.join(THREAD_END_TIMEOUT_S)
    assert not waiter.is_alive(), "close() did not end a next() waiting in another thread"
    assert len(waiter_ended_with) == 1 and isinstance(waiter_ended_with[0], StopIteration)
    release_source.set()
    _wait_until_ended(iterator.thread)
