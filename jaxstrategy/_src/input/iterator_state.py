"""Where a pass over a distributed dataset stands: what `DistributedIterator.get_state` saves.

A pass's position counts, for each of its sources (one per input pipeline), the elements that
went into the batches the user has taken (by `next` or `get_next`). The background thread reads
ahead of the user, so what it has read and placed but the user has not taken does not count: the
thread notes each source's position after every batch it makes, and the iterator keeps the note
of the last batch it handed out.

A source's pass is restored in one of two ways:

- its iterator has `get_state()` and `set_state(state)` (Grain's iterators, or any object with
  that protocol): the state it had after the last element taken is saved, and set on a new pass.
  The state must be bytes or JSON-serialisable (dicts, lists, strings, numbers) to be saved; one
  that is not is still read past, and saving the position is the error, naming the source and
  what JSON cannot hold (a numpy integer, say): a pass nobody saves needs no state;
- any other re-iterable source: a new pass is started and the consumed elements are read and
  dropped. That costs what reading them costs (none is copied or placed on a device), and a skip
  that takes longer than `SLOW_SKIP_S` warns. The source must yield the same elements on every
  pass it starts, as a list does; a shuffle must be seeded, by epoch for instance.

A one-shot source (a generator object) cannot start a new pass, so unless it has the protocol
its position can never be restored: `get_state` says so rather than save one.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.errors import caller_stacklevel

# A restore whose skipping of consumed elements takes longer than this warns.
SLOW_SKIP_S = 10.0

_KEYS = ("pass", "batches", "elements", "source_states", "end")


@dataclasses.dataclass(frozen=True)
class UnsavableState:
    """A source's `get_state()` that is neither bytes nor JSON: why, kept for the error that
    saving the position raises (iterating goes on)."""

    iterator_type: str
    problem: str


# (elements read, encoded state after the last one or None): a source's position.
SourceMark = tuple[int, str | UnsavableState | None]


def is_stateful(iterator: Any) -> bool:
    """Whether `iterator` has the `get_state()` / `set_state(state)` protocol (Grain's iterators)."""
    return callable(getattr(iterator, "get_state", None)) and callable(getattr(iterator, "set_state", None))


def encode_source_state(state: Any, source: Any) -> str | UnsavableState:
    """A source's `get_state()` as a JSON string (bytes as base64), copied, so later changes to it
    do not reach a saved position; or, where JSON cannot hold it, why not.

    The reader thread calls this after every element, so a state that is not JSON is not an
    error here: only saving it is (`PassPosition.as_state`)."""
    if isinstance(state, bytes | bytearray):
        return json.dumps({"bytes": base64.b64encode(state).decode("ascii")})
    try:
        return json.dumps({"json": state})
    except (TypeError, ValueError) as error:
        problem = _unencodable_part(state, "state", set()) or f"state is {_type_name(state)} ({error})"
        return UnsavableState(type(source).__name__, problem)


def _unencodable_part(value: Any, path: str, seen: set[int]) -> str | None:
    """Where in `value` JSON fails, such as `"state['index'] is a numpy int64"`, or None."""
    if value is None or isinstance(value, str | int | float):
        return None
    if isinstance(value, dict | list | tuple):
        if id(value) in seen:
            return f"{path} contains itself"
        seen.add(id(value))  # Only while inside it: a list met twice, not within itself, is fine.
        try:
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(value, dict) and not (key is None or isinstance(key, str | int | float)):
                    return f"{path} has the key {key!r}, {_type_name(key)}"
                found = _unencodable_part(item, f"{path}[{key!r}]", seen)
                if found:
                    return found
            return None
        finally:
            seen.discard(id(value))
    return f"{path} is {_type_name(value)}"


def _type_name(value: Any) -> str:
    """`value`'s type with its article: "a numpy int64", "an object"."""
    kind = type(value)
    name = f"numpy {kind.__name__}" if kind.__module__ == "numpy" else kind.__qualname__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def decode_source_state(encoded: str) -> Any:
    """What `encode_source_state` encoded, as `get_state()` returned it."""
    tagged = json.loads(encoded)
    if "bytes" in tagged:
        return base64.b64decode(tagged["bytes"])
    return tagged["json"]


@dataclasses.dataclass(frozen=True)
class PassPosition:
    """How far the user has taken one pass: its number, the batches taken, and per source the
    elements those batches used (with the source's own state where it has one)."""

    pass_index: int
    batches: int
    elements: tuple[int, ...]
    source_states: tuple[str | UnsavableState | None, ...]
    end: bool = False

    @classmethod
    def start(cls, pass_index: int, num_sources: int) -> PassPosition:
        return cls(pass_index, 0, (0,) * num_sources, (None,) * num_sources)

    def after(self, marks: tuple[SourceMark, ...], *, taken: int) -> PassPosition:
        """The position once `taken` more batches are taken, the last of them (or a dropped one
        after it) having come with `marks`."""
        return dataclasses.replace(
            self,
            batches=self.batches + taken,
            elements=tuple(count for count, _ in marks),
            source_states=tuple(state for _, state in marks),
        )

    def as_state(self, *, caller: str) -> dict[str, Any]:
        """The position as a small JSON-serialisable dict.

        Raises:
          TypeError: a source's `get_state()` gave a state that JSON cannot hold.
        """
        source_states = []
        for index, state in enumerate(self.source_states):
            if isinstance(state, UnsavableState):
                where = f"input pipeline {index}" if len(self.source_states) > 1 else "the dataset's source"
                raise TypeError(
                    f"{caller}: the get_state() of the iterator of {where} ({state.iterator_type}) "
                    f"returned a state that is neither bytes nor JSON, so this position cannot be "
                    f"saved: {state.problem}. Return bytes, or dicts, lists, strings, numbers, "
                    "booleans and None of Python's own types, from get_state() (int(x) for a numpy "
                    "integer)."
                )
            source_states.append(None if state is None else json.loads(state))
        return {
            "pass": self.pass_index,
            "batches": self.batches,
            "elements": list(self.elements),
            "source_states": source_states,
            "end": self.end,
        }

    @classmethod
    def from_state(cls, state: Any, *, num_sources: int, caller: str) -> PassPosition:
        """Check `state` (from `as_state`, possibly through a checkpoint) and read it.

        Raises:
          TypeError: `state` is not such a dict.
          ValueError: its values are malformed, or it was saved for another number of sources.
        """
        if not isinstance(state, Mapping) or set(state) != set(_KEYS):
            raise TypeError(
                f"{caller}: expected the dict that DistributedIterator.get_state() returns, with the "
                f"keys {list(_KEYS)}; got {_short(state)}."
            )
        elements, states = state["elements"], state["source_states"]
        problems = [
            f"{name}={state[name]!r} is not an int >= 0"
            for name in ("pass", "batches")
            if not _is_count(state[name])
        ]
        if not isinstance(state["end"], bool):
            problems.append(f"end={state['end']!r} is not a bool")
        if not isinstance(elements, list | tuple) or not all(_is_count(n) for n in elements):
            problems.append(f"elements={elements!r} is not a list of ints >= 0")
        if not isinstance(states, list | tuple) or not all(
            s is None or (isinstance(s, Mapping) and len(s) == 1 and set(s) <= {"bytes", "json"})
            for s in states
        ):
            problems.append("source_states is not a list of None or encoded states")
        if problems:
            raise ValueError(f"{caller}: malformed iterator state: {'; '.join(problems)}.")
        if len(elements) != num_sources or len(states) != num_sources:
            raise ValueError(
                f"{caller}: the state is of a pass over {len(elements)} input pipeline(s), but this "
                f"dataset reads {num_sources}. Restore it into an iterator of the same dataset, made "
                "by the same call (with the same InputReplicationMode)."
            )
        return cls(
            pass_index=state["pass"],
            batches=state["batches"],
            elements=tuple(elements),
            source_states=tuple(None if s is None else json.dumps(s) for s in states),
            end=state["end"],
        )


def _is_count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


class SourceReader:
    """One pass over one source: its elements, counting them and, where the source's iterator has
    the get_state/set_state protocol, noting its state after each (in the thread that reads them)."""

    def __init__(self, iterator: Iterator[Any], *, count: int = 0, state: str | UnsavableState | None = None):
        self._iterator: Any = iterator
        self._stateful = is_stateful(iterator)
        self.count = count
        self.state = state

    def __iter__(self) -> SourceReader:
        return self

    def __next__(self) -> Any:
        element = next(self._iterator)
        self.count += 1
        if self._stateful:
            self.state = encode_source_state(self._iterator.get_state(), self._iterator)
        return element

    @property
    def mark(self) -> SourceMark:
        return self.count, self.state


def resume_sources(
    starts: list[Callable[[], Iterator[Any]]], position: PassPosition, *, caller: str
) -> list[SourceReader]:
    """New passes over the sources, each at its place in `position`.

    A source saved with its own state gets it back through `set_state`; any other is read and its
    first `position.elements[i]` elements dropped, here, in the caller's thread, with a warning
    when that takes longer than `SLOW_SKIP_S`.

    Raises:
      ValueError: a source saved with a state has no `set_state` now, or a source ends before the
        saved number of elements (it is not the source that was saved).
    """
    readers = []
    skipped, started = 0, time.perf_counter()
    for index, (start, count, state) in enumerate(
        zip(starts, position.elements, position.source_states, strict=True)
    ):
        iterator: Any = start()
        where = f"input pipeline {index}" if len(starts) > 1 else "the dataset's source"
        if state is not None:
            # A position to resume comes from `PassPosition.from_state`: its states are JSON.
            assert isinstance(state, str), state
            if not is_stateful(iterator):
                raise ValueError(
                    f"{caller}: the state was saved from a source whose iterator has get_state() and "
                    f"set_state(), but the iterator of {where} is a {type(iterator).__name__} without "
                    "them. Restore it into an iterator of the same dataset."
                )
            iterator.set_state(decode_source_state(state))
        else:
            for read in range(count):
                try:
                    next(iterator)
                except StopIteration:
                    raise ValueError(
                        f"{caller}: {where} ended after {read} elements, but the state says "
                        f"{count} were taken when it was saved: this is not the source it was saved "
                        "from, or its passes differ (a source restored by skipping must yield the "
                        "same elements on every pass)."
                    ) from None
            skipped += count
        readers.append(SourceReader(iterator, count=count, state=state))
    elapsed = time.perf_counter() - started
    if elapsed > SLOW_SKIP_S:
        warnings.warn(
            f"{caller}: restoring the iterator read and dropped {skipped} elements of its source(s) to "
            f"reach the saved position, which took {elapsed:.1f} s. A source whose iterator has "
            "get_state() and set_state() (as Grain's have) is restored without reading them.",
            stacklevel=caller_stacklevel(),
        )
    return readers
