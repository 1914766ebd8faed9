"""Where a pass over a distributed dataset stands: what `DistributedIterator.get_state` saves.

A position counts, for each source, the elements that went into the batches the user has taken,
not what the input thread read ahead. A source's pass is restored by its own iterator's
`get_state`/`set_state` (Grain's), or else by reading the consumed elements again, checked by a
fingerprint of the last one. docs/internals.md, "Input", tells why and what each way demands.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import google_crc32c
import jax
import numpy as np

from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.errors import caller_stacklevel

# A restore whose skipping of consumed elements takes longer than this warns.
SLOW_SKIP_S = 10.0

_KEYS = ("pass", "batches", "elements", "source_states", "end")
# Saved since fingerprints were added; a position saved before has none, and restores unchecked.
_FINGERPRINTS = "fingerprints"
# A leaf's bytes summed for its fingerprint: all of them up to twice this, else the first and the
# last this many, so a batch of images costs no more than a small one (its cost: docs/performance.md,
# "The input pipeline"); other data in another order differs within the first rows.
_SUMMED_BYTES = 1 << 18


@dataclasses.dataclass(frozen=True)
class UnsavableState:
    """A source's `get_state()` that is neither bytes nor JSON: why, kept for the error that
    saving the position raises (iterating goes on)."""

    iterator_type: str
    problem: str


# (elements read, encoded state after the last one or None, fingerprint of the last one or
# None): a source's position.
SourceMark = tuple[int, str | UnsavableState | None, int | None]


def fingerprint(leaves: Sequence[Any]) -> int:
    """A CRC32C of an element's leaves: each one's dtype, shape and bytes (at most its first and
    last `_SUMMED_BYTES`). A jax array counts by dtype and shape only: its bytes may be on a
    device, and reading them back would cost a transfer per batch."""
    crc = 0
    for leaf in leaves:
        dtype = leaf.dtype  # A PRNG key array's is JAX's own, not numpy's.
        kind = dtype.str if isinstance(dtype, np.dtype) else str(dtype)
        crc = google_crc32c.extend(crc, f"{kind}{tuple(leaf.shape)};".encode())
        if isinstance(leaf, jax.Array):
            continue
        data = np.ascontiguousarray(leaf).reshape(-1).view(np.uint8)
        if data.size > 2 * _SUMMED_BYTES:
            data = np.concatenate([data[:_SUMMED_BYTES], data[-_SUMMED_BYTES:]])
        crc = google_crc32c.extend(crc, data.tobytes())
    return int(crc)


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
    fingerprints: tuple[int | None, ...]
    end: bool = False

    @classmethod
    def start(cls, pass_index: int, num_sources: int) -> PassPosition:
        return cls(pass_index, 0, (0,) * num_sources, (None,) * num_sources, (None,) * num_sources)

    def after(self, marks: tuple[SourceMark, ...], *, taken: int) -> PassPosition:
        """The position once `taken` more batches are taken, the last of them (or a dropped one
        after it) having come with `marks`."""
        return dataclasses.replace(
            self,
            batches=self.batches + taken,
            elements=tuple(count for count, _, _ in marks),
            source_states=tuple(state for _, state, _ in marks),
            fingerprints=tuple(fingerprint for _, _, fingerprint in marks),
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
            _FINGERPRINTS: list(self.fingerprints),
        }

    @classmethod
    def from_state(cls, state: Any, *, num_sources: int, caller: str) -> PassPosition:
        """Check `state` (from `as_state`, possibly through a checkpoint) and read it.

        Raises:
          TypeError: `state` is not such a dict.
          ValueError: its values are malformed, or it was saved for another number of sources.
        """
        if not isinstance(state, Mapping) or set(state) - {_FINGERPRINTS} != set(_KEYS):
            raise TypeError(
                f"{caller}: expected the dict that DistributedIterator.get_state() returns, with the "
                f"keys {[*_KEYS, _FINGERPRINTS]}; got {_short(state)}."
            )
        elements, states = state["elements"], state["source_states"]
        fingerprints = state.get(_FINGERPRINTS, ())  # None before fingerprints were saved.
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
        if not isinstance(fingerprints, list | tuple) or not all(
            f is None or _is_count(f) for f in fingerprints
        ):
            problems.append(f"fingerprints={fingerprints!r} is not a list of None or ints >= 0")
        if problems:
            raise ValueError(f"{caller}: malformed iterator state: {'; '.join(problems)}.")
        if _FINGERPRINTS not in state:
            fingerprints = [None] * len(elements)
        if len(elements) != num_sources or len(states) != num_sources or len(fingerprints) != num_sources:
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
            fingerprints=tuple(fingerprints),
            end=state["end"],
        )


def _is_count(value: Any) -> bool:
    return is_int(value) and value >= 0


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}..."


class SourceReader:
    """One pass over one source: its elements, counting them and, where the source's iterator has
    the get_state/set_state protocol, noting its state after each (in the thread that reads them).
    A source without it is restored by skipping, so `fingerprinted` notes each element's
    fingerprint instead."""

    def __init__(
        self,
        iterator: Iterator[Any],
        *,
        count: int = 0,
        state: str | UnsavableState | None = None,
        fingerprint: int | None = None,
    ):
        self._iterator: Any = iterator
        self._stateful = is_stateful(iterator)
        self.count = count
        self.state = state
        self.fingerprint = fingerprint

    def __iter__(self) -> SourceReader:
        return self

    def __next__(self) -> Any:
        element = next(self._iterator)
        self.count += 1
        if self._stateful:
            self.state = encode_source_state(self._iterator.get_state(), self._iterator)
        return element

    def fingerprinted(self, elements: Iterator[Any], leaves: Callable[[Any], Sequence[Any]]) -> Iterator[Any]:
        """`elements` (this reader's, as host copies), noting the fingerprint of each one's
        `leaves` as it passes, unless the source restores from its own state. Only the number
        is kept, not the element."""
        for element in elements:
            if not self._stateful:
                self.fingerprint = fingerprint(leaves(element))
            yield element

    @property
    def mark(self) -> SourceMark:
        return self.count, self.state, self.fingerprint


def resume_sources(
    starts: list[Callable[[], Iterator[Any]]],
    position: PassPosition,
    *,
    fingerprint_of: Callable[[Any], int],
    caller: str,
) -> list[SourceReader]:
    """New passes over the sources, each at its place in `position`.

    A source saved with its own state gets it back through `set_state`; any other is read and its
    first `position.elements[i]` elements dropped, here, in the caller's thread, with a warning
    when that takes longer than `SLOW_SKIP_S`. The last of those must have the fingerprint saved
    with the position (`fingerprint_of` computes it from an element as the source yields it),
    where one was saved.

    Raises:
      ValueError: a source saved with a state has no `set_state` now, a source ends before the
        saved number of elements (it is not the source that was saved), or its last element
        skipped is not the one saved (the source yields other elements on this pass).
    """
    readers = []
    skipped, started = 0, time.perf_counter()
    for index, (start, count, state, saved) in enumerate(
        zip(starts, position.elements, position.source_states, position.fingerprints, strict=True)
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
            element = None
            for read in range(count):
                try:
                    element = next(iterator)
                except StopIteration:
                    raise ValueError(
                        f"{caller}: {where} ended after {read} elements, but the state says "
                        f"{count} were taken when it was saved: this is not the source it was saved "
                        "from, or its passes differ (a source restored by skipping must yield the "
                        "same elements on every pass)."
                    ) from None
            skipped += count
            if count and saved is not None and fingerprint_of(element) != saved:
                raise ValueError(_changed_source(where, count, position.pass_index, caller))
        readers.append(SourceReader(iterator, count=count, state=state, fingerprint=saved))
    elapsed = time.perf_counter() - started
    if elapsed > SLOW_SKIP_S:
        warnings.warn(
            f"{caller}: restoring the iterator read and dropped {skipped} elements of its source(s) to "
            f"reach the saved position, which took {elapsed:.1f} s. A source whose iterator has "
            "get_state() and set_state() (as Grain's have) is restored without reading them.",
            stacklevel=caller_stacklevel(),
        )
    return readers


def _changed_source(where: str, count: int, pass_index: int, caller: str) -> str:
    return (
        f"{caller}: {where} yields other elements on this pass than when the position was saved: "
        f"its element {count - 1} (from 0), the last taken before the save, differs from the one "
        f"taken then (their fingerprints differ), so resuming would train on other data. The saved "
        f"position is in pass {pass_index} (from 0) of the dataset, and a source restored by "
        "skipping must yield that pass's elements again: seed its shuffle (and any random "
        "augmentation) by that pass number, set before restoring, not by a counter that restarts "
        "at 0 in a new process; or give its iterator get_state() and set_state(), as Grain's have, "
        "to be restored from its own state. See 'Several epochs' in docs/checkpoints.md."
    )
