"""A host-to-device prefetch iterator: a background thread keeps `buffer_size` elements placed ahead.

Two placed batches in flight (double buffering) let the transfer of batch k+1 overlap the step on
batch k. The iterator knows no strategy: a `put` function turns each host element into what the
consumer receives. Its lifetime rules (when the thread ends, where errors surface, how many
elements live at once) are listed in docs/internals.md, "Input"; each one is tested.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

# How often a consumer waiting for the next element checks that the producer thread is alive.
_LIVENESS_POLL_S = 1.0
# How long exit waits, in all, for the producer threads still running: the waits in a producer's
# source (the multi-process input agreement's) check `stopped` every second.
_EXIT_JOIN_S = 2.0


class _End:
    """Put in the queue after the source's last element."""


class _Failure:
    """Put in the queue when the source or `put` raised; carries the exception."""

    def __init__(self, error: BaseException):
        self.error = error


class _Channel:
    """What the producer thread and the consumer share. It never refers to the iterator."""

    def __init__(self, buffer_size: int, stopped: threading.Event):
        self.items: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.free_slots = threading.Semaphore(buffer_size)
        self.stopped = stopped
        self.producer: threading.Thread | None = None

    def stop(self) -> None:
        """Ask the producer to end, wake whoever waits on the channel, and drop what was placed.

        Its time does not depend on the buffer size, only on how many elements were placed.
        """
        self.stopped.set()
        # One release wakes the producer: it is the only thread that waits for a slot, and once
        # awake it sees `stopped` and ends. Releasing one per slot instead made closing take as
        # long as the buffer is large, at the end of every pass (docs/performance.md, "The input
        # pipeline").
        self.free_slots.release()
        while True:
            try:
                self.items.get_nowait()
            except queue.Empty:
                break
        # Wakes a consumer waiting for an element in another thread: its pass is over.
        self.items.put(_End())


# The channels of producer threads that may be running: a thread holds its channel until it ends.
_CHANNELS: weakref.WeakSet[_Channel] = weakref.WeakSet()


@atexit.register
def _stop_producers() -> None:
    """Stop every producer thread still running, and wait for each (bounded)."""
    channels = list(_CHANNELS)
    for channel in channels:
        channel.stop()
    deadline = time.monotonic() + _EXIT_JOIN_S
    for channel in channels:
        if channel.producer is not None:
            channel.producer.join(timeout=max(0.0, deadline - time.monotonic()))


def _produce(source: Iterator[Any], put: Callable[[Any], Any], channel: _Channel) -> None:
    try:
        while True:
            channel.free_slots.acquire()
            if channel.stopped.is_set():
                return
            try:
                element = next(source)
            except StopIteration:
                channel.items.put(_End())
                return
            placed = put(element)
            if channel.stopped.is_set():
                return  # Closed while placing: nobody will take it, so it must not stay in the queue.
            channel.items.put(placed)
    except BaseException as error:  # noqa: B036  Everything reaches the consumer, even KeyboardInterrupt.
        channel.items.put(_Failure(error))
    finally:
        close = getattr(source, "close", None)
        if callable(close):
            close()  # Ends a generator source stopped early, running its finally blocks here.


class PrefetchIterator(Generic[T]):
    """Iterate over `put(element)` for each element of `source`, `buffer_size` elements ahead.

    Args:
      source: an iterator of host elements. It is read only by the producer thread (or, with
        `buffer_size=0`, by the consumer).
      put: turns a host element into what `__next__` returns, such as arrays on a device. It
        runs in the producer thread.
      buffer_size: how many elements to keep placed ahead; 0 means no thread: each element is
        read and placed when asked for.
      name: the producer thread's name, for debuggers and thread dumps.
      stopped: an event to set when the iterator is closed or collected, for a source that waits
        on something else (and should stop waiting then); a new one when None.

    Example:
      >>> iterator = PrefetchIterator(iter([1, 2, 3]), put=lambda x: x * 10, buffer_size=2)
      >>> list(iterator)
      [10, 20, 30]
    """

    def __init__(
        self,
        source: Iterator[Any],
        put: Callable[[Any], T],
        buffer_size: int,
        *,
        name: str = "jaxstrategy-prefetch",
        stopped: threading.Event | None = None,
    ):
        self._lookahead: list[T] = []
        self._finished = False
        # Held while taking an element, so threads sharing the iterator never take the same one and
        # all see the end. Re-entrant: `peek` calls `next`, and a failing `next` calls `close`.
        self._lock = threading.RLock()
        self._stopped = threading.Event() if stopped is None else stopped
        if buffer_size == 0:
            self._source: Iterator[Any] | None = source
            self._put = put
            self._channel: _Channel | None = None
            self._thread: threading.Thread | None = None
            return
        self._source = None
        self._channel = _Channel(buffer_size, self._stopped)
        self._thread = threading.Thread(
            target=_produce, args=(source, put, self._channel), name=name, daemon=True
        )
        self._channel.producer = self._thread
        _CHANNELS.add(self._channel)
        self._thread.start()
        # Garbage collection of the iterator stops the thread; the finalizer refers to the channel only.
        self._finalizer = weakref.finalize(self, self._channel.stop)

    def __iter__(self) -> PrefetchIterator[T]:
        return self

    def __next__(self) -> T:
        with self._lock:
            if self._lookahead:
                return self._lookahead.pop()
            if self._finished:
                raise StopIteration
            try:
                return self._take()
            except BaseException:
                self.close()
                raise

    def peek(self) -> T:
        """Return the next element without consuming it; StopIteration at the end."""
        with self._lock:
            if not self._lookahead:
                self._lookahead.append(next(self))
            return self._lookahead[0]

    def close(self) -> None:
        """Stop the producer thread and drop the elements it placed ahead.

        Safe to call twice, and from another thread than one waiting in `next`, which then raises
        StopIteration. With `buffer_size=0`, it waits for a read in progress in another thread.
        """
        self._finished = True
        # Stopping before taking the lock ends a `next` in progress that holds it: a waiting
        # consumer is woken with the end, and a source that waits on `stopped` returns.
        self._stopped.set()
        if self._channel is not None:
            self._finalizer()
        with self._lock:
            self._lookahead.clear()
            if self._source is not None:
                close = getattr(self._source, "close", None)
                if callable(close):
                    close()
                self._source = None

    @property
    def thread(self) -> threading.Thread | None:
        """The producer thread, or None with `buffer_size=0`."""
        return self._thread

    def _take(self) -> T:
        if self._channel is None:
            assert self._source is not None
            try:
                element = next(self._source)
            except StopIteration:
                self._finished = True
                raise
            return self._put(element)
        item = self._wait_for_item(self._channel)
        self._channel.free_slots.release()
        if isinstance(item, _End):
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise item.error
        return item

    def _wait_for_item(self, channel: _Channel) -> Any:
        while True:
            try:
                return channel.items.get(timeout=_LIVENESS_POLL_S)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and channel.items.empty():
                    raise RuntimeError(
                        "The input thread ended without delivering an element or an error; the "
                        "process may be shutting down."
                    ) from None
