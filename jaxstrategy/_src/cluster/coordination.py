"""JAX's coordination service, as jaxstrategy uses it: the one module that talks to its store.

Every process of a `jax.distributed` job reaches one key-value store through its coordinator
(process 0). Every protocol of the library goes through `KeyValueStore` here, so that what they
ask of that one server can be read, and counted (`count_operations`), in one place; the answers'
meanings are in docs/internals.md, "The cluster". tests/cluster/test_coordination.py fails if
another module calls the client's key-value methods.
"""

from __future__ import annotations

import collections
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax

from jaxstrategy._src.core.jax_compat import coordination_client

# How the service says that a blocking read found nothing in time, that a key is missing, and that
# a key written without overwriting was there already (jax 0.10.2).
_DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
_NOT_FOUND = "NOT_FOUND"
_ALREADY_EXISTS = "ALREADY_EXISTS"
PREFIX = "jaxstrategy"
_namespace_serials: dict[str, Iterator[int]] = collections.defaultdict(itertools.count)


def new_namespace(kind: str) -> str:
    """A fresh key prefix for one use of a protocol, such as `jaxstrategy/input/3`: the same on
    every process, because every process makes the same calls in the same order."""
    return f"{PREFIX}/{kind}/{next(_namespace_serials[kind])}"


class OperationCounts:
    """How many calls this process made to the store, by the protocol's kind (the key's second
    part: `input`, `programs`, `ended`, ...) and the client's method. See `count_operations`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_kind: collections.Counter[tuple[str, str]] = collections.Counter()

    def add(self, method: str, key: str) -> None:
        parts = key.split("/")
        kind = parts[1] if len(parts) > 1 and parts[0] == PREFIX else key
        with self._lock:
            self.by_kind[kind, method] += 1

    def total(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(n for (k, _), n in self.by_kind.items() if kind is None or k == kind)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            table: dict[str, dict[str, int]] = {}
            for (kind, method), n in sorted(self.by_kind.items()):
                table.setdefault(kind, {})[method] = n
            return table


_counts: OperationCounts | None = None


def count_operations() -> OperationCounts:
    """Count every call this process makes to the store from now on (for benchmarks and tests):
    returns the counts, which grow as calls are made."""
    global _counts
    _counts = OperationCounts()
    return _counts


class KeyValueStore:
    """The coordination service's key-value store, as the library's protocols use it.

    Args:
      client: JAX's coordination client (the running job's when None), or a stand-in with the
        same methods in tests.
    """

    def __init__(self, client: Any = None):
        self._given = client is not None
        self.client = client if self._given else coordination_client()

    def _count(self, method: str, key: str) -> None:
        if _counts is not None:
            _counts.add(method, key)

    def is_current(self) -> bool:
        """Whether JAX's distributed runtime still runs with this store's client (the program
        may have called `jax.distributed.shutdown()`); always, for a client given to the store."""
        return self._given or coordination_client() is self.client

    def set(self, key: str, value: str, *, overwrite: bool = False) -> None:
        self._count("set", key)
        if overwrite:
            self.client.key_value_set(key, value, allow_overwrite=True)
        else:
            self.client.key_value_set(key, value)

    def set_once(self, key: str, value: str) -> bool:
        """Set `key` unless some process has set it already; whether this call set it."""
        self._count("set", key)
        try:
            self.client.key_value_set(key, value)
        except jax.errors.JaxRuntimeError as error:
            if _ALREADY_EXISTS not in str(error):
                raise
            return False
        return True

    def get_now(self, key: str) -> str | None:
        """The value of `key`, or None when no process has set it."""
        self._count("try_get", key)
        try:
            return str(self.client.key_value_try_get(key))
        except jax.errors.JaxRuntimeError as error:
            if _NOT_FOUND not in str(error):
                raise
            return None

    def get_within(self, key: str, timeout_ms: int) -> str | None:
        """The value of `key` once some process sets it, or None if none does within `timeout_ms`
        (the service's `DEADLINE_EXCEEDED`). Any other error of the service is raised."""
        self._count("blocking_get", key)
        try:
            return str(self.client.blocking_key_value_get(key, timeout_ms))
        except jax.errors.JaxRuntimeError as error:
            if _DEADLINE_EXCEEDED not in str(error):
                raise
            return None

    def wait_for(
        self,
        key: str,
        *,
        deadline: float | None = None,
        stop: threading.Event | None = None,
        poll_ms: int = 1000,
        interrupt: Callable[[], None] | None = None,
    ) -> str | None:
        """The value of `key` once set, waiting `poll_ms` at a time; None when `stop` is set or
        `deadline` (a `time.monotonic()` time) passes first. Between two polls it calls
        `interrupt`, which ends the wait by raising (an error another process posted, say)."""
        while stop is None or not stop.is_set():
            value = self.get_within(key, poll_ms)
            if value is not None:
                return value
            if interrupt is not None:
                interrupt()
            if deadline is not None and time.monotonic() > deadline:
                return None
        return None

    def increment(self, key: str, amount: int) -> int:
        """Add `amount` to the counter `key` (0 when unset), atomically; the new count."""
        self._count("increment", key)
        return int(self.client.key_value_increment(key, amount))

    def values_under(self, directory: str) -> dict[str, str]:
        """Every key under `directory` (which ends with '/') with its value, in one call."""
        self._count("dir_get", directory)
        return {str(key): str(value) for key, value in self.client.key_value_dir_get(directory)}

    def delete(self, key: str) -> None:
        """Delete `key` and every key under it."""
        self._count("delete", key)
        self.client.key_value_delete(key)


def every_process_value(value: str, *, caller: str, timeout_s: float) -> dict[int, str]:
    """Post `value` and return every process's, by process index: a gather through the service.

    Each process writes its value under a key of its own (the calls' order, the same on every
    process, names the call) and counts itself in; the last to arrive reads them all at once and
    publishes them together, which the others read: about 4N calls to the service in all, where
    each process reading every other's would take N * N. The last to read deletes the keys.

    Raises:
      TimeoutError: some process did not make this call within `timeout_s`.
    """
    store = KeyValueStore()
    n, me = jax.process_count(), jax.process_index()
    namespace = new_namespace("values")
    store.set(f"{namespace}/value/{me}", value)
    if store.increment(f"{namespace}/count", 1) == n:
        found = store.values_under(f"{namespace}/value/")
        values = {int(key.rpartition("/")[2]): found[key] for key in found}
        store.set(f"{namespace}/all", json.dumps(values))
    else:
        everyone = store.get_within(f"{namespace}/all", int(timeout_s * 1000))
        if everyone is None:
            arrived = int(store.get_now(f"{namespace}/count") or 0)
            raise TimeoutError(
                f"{caller}: process {me} waited {timeout_s:.0f} s for the other processes to make the "
                f"same call, and only {arrived} of {n} did. Every process must make the same calls in "
                "the same order."
            )
        values = {int(process): found for process, found in json.loads(everyone).items()}
    if store.increment(f"{namespace}/done", 1) == n:
        store.delete(namespace)
    return values


def require_same_on_every_process(
    signature: str,
    *,
    what: str,
    caller: str,
    timeout_s: float,
    shared: dict[str, str] | None = None,
) -> None:
    """Raise a ValueError on every process unless all of them pass the same `signature`, and
    those that pass a value under one key of `shared` (say, a replica they share) the same one.

    Raises:
      ValueError: the signatures differ, or two processes' values under one key of `shared`;
        the message lists each process's.
      TimeoutError: some process did not make this call within `timeout_s`.
    """
    posted = every_process_value(
        json.dumps({"signature": signature, "shared": shared or {}}), caller=caller, timeout_s=timeout_s
    )
    found = {process: json.loads(value) for process, value in posted.items()}
    signatures = {process: value["signature"] for process, value in found.items()}
    if len(set(signatures.values())) > 1:
        lines = "".join(f"\n  process {process}: {s}" for process, s in sorted(signatures.items()))
        raise ValueError(
            f"{caller}: {what} differ between processes in structure, shape or dtype, so they cannot "
            f"make one value over every replica (one program runs on all of them):{lines}\nMake every "
            "process's results the same shape and dtype."
        )
    by_key: dict[str, dict[str, list[int]]] = {}
    for process, value in sorted(found.items()):
        for key, content in value["shared"].items():
            by_key.setdefault(key, {}).setdefault(content, []).append(process)
    differing = sorted((key, groups) for key, groups in by_key.items() if len(groups) > 1)
    if differing:
        key, groups = differing[0]
        holders = "; ".join(
            f"process{'es' if len(p) > 1 else ''} {', '.join(map(str, p))}" for p in groups.values()
        )
        raise ValueError(
            f"{caller}: {what} for replica {key} differ between the processes that share it "
            f"({holders} gave different values), so its devices would hold different copies of "
            "one value. Every process that holds a replica must compute the same result for it: "
            "seed random numbers by the replica id (context.replica_id_in_sync_group), not by "
            "the process."
        )
