"""Every process of a job runs the same step program at each `run` call, or every process stops.

Collectives pair up between processes by order alone, so a process that runs another program at
some step (a branch on `jax.process_index()`, say) exchanges mismatched data with no error. Each
process records the programs its `run` calls ran, by their jaxprs' fingerprints; a thread
compares them with the other processes' every few calls, through JAX's coordination service, and
a difference makes `run` raise. docs/internals.md, "The cluster", tells how, and when it is seen.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import queue
import re
import threading
import types
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jaxstrategy._src.cluster.coordination import KeyValueStore, new_namespace
from jaxstrategy._src.core.types import PyTree

# How many `run` calls a round covers, once a job has run a while: the bound, in calls, within
# which one process finds a difference, and the number of steps over which a round's 3N + 2
# calls to the service are spread.
CALLS_PER_ROUND = 64
# The first round's calls. Each round after covers as many calls as all before it, up to
# CALLS_PER_ROUND (rounds close at calls 4, 8, 16, 32, 64, then every 64), so that a job's first
# steps, where a branch on the process usually shows, and short jobs are compared early.
FIRST_ROUND_CALLS = 4
# Memory addresses in the printed jaxpr (of functions held by custom_jvp, say) differ between
# processes running the same program.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MethodType = types.MethodType
# How many functions' names a check keeps.
_MAX_NAMES = 4096


def function_key(fn: Callable[..., Any]) -> Hashable:
    """A step function's identity while it lives, as `StepCache` keys it: a bound method, made
    afresh at each `obj.method`, by its object and function."""
    if type(fn) is _MethodType:
        return (id(fn.__self__), id(fn.__func__))
    return id(fn)


def program_name(fn: Callable[..., Any], fingerprint: str | None = None) -> str:
    """How messages name a step program: its function's qualified name, with a fingerprint (of
    its traced program, or of its code) when known."""
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    qualified = f"{module}.{name}" if module and module not in ("__main__", "builtins") else name
    return qualified if fingerprint is None else f"{qualified} ({fingerprint})"


def jaxpr_fingerprint(jaxpr: Any) -> str:
    """A short fingerprint of a traced program, the same on every process that traced it alike:
    its text, and the values of the constants it closes over (the text names them only), read
    where this process holds them whole."""
    digest = hashlib.sha256(_ADDRESS.sub("", str(jaxpr)).encode())
    for const in getattr(jaxpr, "consts", ()):
        digest.update(f"{getattr(const, 'shape', ())}{getattr(const, 'dtype', type(const))}".encode())
        if not isinstance(const, jax.Array) or const.is_fully_addressable:
            digest.update(np.ascontiguousarray(np.asarray(const)).tobytes())
    return digest.hexdigest()[:8]


class ProgramAgreement:
    """One strategy's check that every process runs the same programs (docs/internals.md, "The cluster").

    Args:
      caller: the call to name in messages, such as `MultiWorkerMirroredStrategy.run()`.
      client: the coordination service's client (JAX's when None).
      num_processes: how many processes take part (JAX's process count when None).
      process_id: this process's index among them (JAX's when None).
      calls_per_round: how many `run` calls a round covers.
      namespace: the check's key prefix, the same on every process (a new one when None).
    """

    def __init__(
        self,
        *,
        caller: str,
        client: Any = None,
        num_processes: int | None = None,
        process_id: int | None = None,
        calls_per_round: int = CALLS_PER_ROUND,
        namespace: str | None = None,
    ):
        self._store = KeyValueStore(client)
        self._num_processes = jax.process_count() if num_processes is None else num_processes
        self._process_id = jax.process_index() if process_id is None else process_id
        self._namespace = new_namespace("programs") if namespace is None else namespace
        self._caller = caller
        self._calls_per_round = calls_per_round
        # Function key -> its program's name, set when it is traced (`fingerprinting`).
        self._names: dict[Hashable, str] = {}
        self._calls = 0
        self._rounds = 0
        # The call count at which the current round closes, and at which the last one closed.
        self._closes_at = min(FIRST_ROUND_CALLS, calls_per_round)
        self._closed_at = 0
        # This round's programs so far, as [name, number of calls in a row].
        self._round: list[list[Any]] = []
        # The previous call's function: it is named once its call traced it (or not).
        self._previous: Callable[..., Any] | None = None
        # Where the processes' programs first differed, once a round found it.
        self._difference: str | None = None
        # Rounds closed and not yet compared, for the thread that talks to the service (started
        # at the first round), so that no step waits for a round trip to the coordinator.
        self._rounds_to_compare: queue.Queue[tuple[int, int, str] | None] = queue.Queue()
        self._comparer: threading.Thread | None = None
        self._closed = False

    def fingerprinting(self, fn: Callable[..., Any], program: Callable[..., PyTree]) -> Callable[..., PyTree]:
        """`program` (what `run` compiles of `fn`), naming `fn` by its traced program's
        fingerprint each time it is traced. The program is traced once, as a `jax.jit` inside the
        step (which XLA inlines), whose jaxpr `trace` gives without tracing again; arguments that
        are not arrays (static ones) are held by that inner function, as jit cannot take them.

        A step `run` made of the caller's function (for NNX objects) has `program_of`, which
        gives that function: the name goes to it, since `record` counts what the caller passed."""
        program_of = getattr(fn, "program_of", None)
        named = None if program_of is None else program_of()
        named = fn if named is None else named  # Collected already: fn names itself.
        key = function_key(named)

        def fingerprinted(*args: Any, **kwargs: Any) -> PyTree:
            leaves, treedef = jax.tree.flatten((args, kwargs))
            traced_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

            def with_static_leaves(*traced: Any) -> PyTree:
                full = list(leaves)
                for i, leaf in zip(traced_at, traced, strict=True):
                    full[i] = leaf
                inner_args, inner_kwargs = jax.tree.unflatten(treedef, full)
                return program(*inner_args, **inner_kwargs)

            with_static_leaves.__name__ = with_static_leaves.__qualname__ = program_name(fn)
            jitted = jax.jit(with_static_leaves)
            traced_leaves = [leaves[i] for i in traced_at]
            jaxpr = jitted.trace(*traced_leaves).jaxpr
            self._name(key, named, program_name(named, f"program {jaxpr_fingerprint(jaxpr)}"))
            return jitted(*traced_leaves)  # Traced already: jit's cache has it.

        fingerprinted.__name__ = fingerprinted.__qualname__ = getattr(program, "__name__", "program")
        return fingerprinted

    def record(self, fn: Callable[..., Any]) -> None:
        """Count a `run` call of `fn`; at the end of a round, hand the round over to be compared
        with the other processes' (in a thread: this call does not wait for it).

        Raises:
          RuntimeError: a round found that the processes ran different programs at some call.
        """
        if self._difference is not None:
            self._raise_difference()
        previous, self._previous = self._previous, fn
        if previous is not None:
            self._append(previous)
        self._calls += 1
        if self._calls == self._closes_at:
            self._close_round()

    def settle(self) -> None:
        """Wait until every round closed so far is compared (for tests)."""
        self._rounds_to_compare.join()

    def close(self) -> None:
        """Stop comparing: rounds not yet compared are dropped. At exit, before JAX's client
        shuts down, so that the thread is inside no call to the service then."""
        self._closed = True
        if self._comparer is not None:
            self._rounds_to_compare.put(None)
            self._comparer.join(timeout=5)

    def _append(self, fn: Callable[..., Any]) -> None:
        key = function_key(fn)
        name = self._names.get(key)
        if name is None:  # Not traced through this strategy's run (an NNX step's wrapper was).
            name = self._name(key, fn, program_name(fn, f"code {_code_fingerprint(fn)}"))
        if self._round and self._round[-1][0] == name:
            self._round[-1][1] += 1
        else:
            self._round.append([name, 1])

    def _name(self, key: Hashable, fn: Callable[..., Any], name: str) -> str:
        """Remember `name` for `fn` while it lives: its key (an id) may name another function
        once it is collected, at other times on other processes."""
        owner = fn.__self__ if type(fn) is _MethodType else fn
        try:
            weakref.finalize(owner, self._names.pop, key, None)
        except TypeError:  # Not weakly referenceable: named afresh at each call instead.
            return name
        if len(self._names) >= _MAX_NAMES:  # A new function per step: forget the old ones.
            self._names.clear()
        self._names[key] = name
        return name

    def _close_round(self) -> None:
        posted, self._round = json.dumps(self._round), []
        # The round's first call, counted from 0: each round ends with the call before the one
        # that closes it (named only once that call traced it), so each starts one call early.
        first_call = max(0, self._closed_at - 1)
        self._closed_at = self._calls
        self._closes_at = self._calls + min(self._calls, self._calls_per_round)
        if self._comparer is None:
            # The thread holds the check weakly, so that a check nobody uses any more (its
            # strategy collected) is collected too, which ends the thread.
            self._comparer = threading.Thread(
                target=_compare_rounds,
                args=(self._rounds_to_compare, weakref.ref(self)),
                name="jaxstrategy-programs",
                daemon=True,
            )
            self._comparer.start()
            weakref.finalize(self, self._rounds_to_compare.put, None)
            _RUNNING.add(self)
        self._rounds_to_compare.put((self._rounds, first_call, posted))
        self._rounds += 1

    def _compare_round(self, item: tuple[int, int, str]) -> None:
        try:
            if not self._closed and self._store.is_current() and self._difference is None:
                self._compare(*item)
        except Exception:  # The service is gone (the job is ending): JAX reports that.
            self._closed = True

    def _compare(self, round_index: int, first_call: int, posted: str) -> None:
        """Post this process's round; the last to arrive compares them all; read the verdict."""
        n, me = self._num_processes, self._process_id
        here = f"{self._namespace}/{round_index}"
        self._store.set(f"{here}/round/{me}", posted)
        if self._store.increment(f"{here}/count", 1) == n:
            rounds = {
                int(key.rpartition("/")[2]): json.loads(value)
                for key, value in self._store.values_under(f"{here}/round/").items()
            }
            self._store.delete(here)  # Every process posted; only this one reads them.
            difference = _first_difference(rounds, first_call)
            if difference is not None:
                self._store.set_once(f"{self._namespace}/difference", difference)
        self._difference = self._store.get_now(f"{self._namespace}/difference")

    def _raise_difference(self) -> None:
        raise RuntimeError(
            f"{self._caller}: {self._difference}. Collectives between different programs exchange "
            f"mismatched data without an error, so every process stops (this one at call "
            f"{self._calls}; the processes compare their programs every {self._calls_per_round} "
            "calls, more often at first). Every process must call run with the same function, "
            "traced alike, at the same step: look for a branch on jax.process_index() around or "
            "inside the step, or a function or closure made differently on some process."
        )


def _compare_rounds(
    rounds: queue.Queue[tuple[int, int, str] | None], agreement: weakref.ref[ProgramAgreement]
) -> None:
    """The thread of a `ProgramAgreement`: compare each round handed over, until the check is
    closed or collected (each puts None)."""
    while True:
        item = rounds.get()
        try:
            check = agreement()
            if item is None or check is None:
                return
            check._compare_round(item)
            del check
        finally:
            rounds.task_done()


# The checks whose thread may be running, closed at exit (without keeping them alive before).
_RUNNING: weakref.WeakSet[ProgramAgreement] = weakref.WeakSet()


@atexit.register  # After JAX's own exit hooks (JAX is imported first), so it runs before them.
def _close_running() -> None:
    for agreement in list(_RUNNING):
        agreement.close()


def _first_difference(rounds: dict[int, list[list[Any]]], first_call: int) -> str | None:
    """Where some process's round differs from process 0's: the call, and both programs."""
    expected = _expanded(rounds[0])
    for process in sorted(rounds):
        ran = _expanded(rounds[process])
        if ran == expected:
            continue
        at = next((i for i, (a, b) in enumerate(zip(expected, ran, strict=False)) if a != b), None)
        if at is None:  # One made more calls in the round than the other (it cannot: rounds
            at = min(len(expected), len(ran))  # close at the same call count), or none.
        mine = expected[at] if at < len(expected) else "no program"
        theirs = ran[at] if at < len(ran) else "no program"
        return f"at run call {first_call + at}, process 0 ran {mine} and process {process} ran {theirs}"
    return None


def _expanded(round_: list[list[Any]]) -> list[str]:
    return [name for name, count in round_ for _ in range(count)]


def _code_fingerprint(fn: Callable[..., Any]) -> str:
    """A fingerprint of a function's code, for a function whose program was not traced here."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return "none"
    return hashlib.sha256(_ADDRESS.sub("", repr(_canonical(code))).encode()).hexdigest()[:8]


def _canonical(value: Any) -> Any:
    """`value` (a code object, or one of its constants) in a form whose repr is the same on every
    process: a set's order follows each process's string hashing (PYTHONHASHSEED), so sets become
    sorted tuples; nested code objects are taken apart alike."""
    if isinstance(value, types.CodeType):
        return ("code", value.co_code, _canonical(value.co_consts), value.co_names)
    if isinstance(value, frozenset | set):
        return ("set", tuple(sorted(repr(_canonical(item)) for item in value)))
    if isinstance(value, tuple):
        return tuple(_canonical(item) for item in value)
    return value
