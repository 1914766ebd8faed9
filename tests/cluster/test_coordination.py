"""The coordination service's one home, against a stand-in for JAX's client (one process).

Jobs of several processes use it for real in tests/strategies/test_multi_worker.py,
tests/input/test_agreement.py and tests/checkpoint/test_preemption.py.
"""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

import jax
import pytest

from jaxstrategy._src.cluster import coordination
from jaxstrategy._src.cluster.coordination import KeyValueStore

PACKAGE = Path(coordination.__file__).resolve().parents[2]
# The methods of JAX's coordination client (jax 0.10.2's `DistributedRuntimeClient`) that reach
# the service, and JAX's function that hands out the client.
CLIENT_METHODS = {
    "blocking_key_value_get",
    "blocking_key_value_get_bytes",
    "get_live_nodes",
    "key_value_delete",
    "key_value_dir_get",
    "key_value_dir_get_bytes",
    "key_value_increment",
    "key_value_set",
    "key_value_set_bytes",
    "key_value_try_get",
    "key_value_try_get_bytes",
    "wait_at_barrier",
    "coordination_client",
}
# Where they may be named: the one home, and jax_compat, which finds the client in JAX.
ALLOWED = {PACKAGE / "_src" / "cluster" / "coordination.py", PACKAGE / "_src" / "core" / "jax_compat.py"}


class _Client:
    """The key-value part of JAX's coordination client, in memory, with its errors."""

    def __init__(self, fail_with: str | None = None):
        self.store: dict[str, str] = {}
        self.waited_ms: list[int] = []
        self._fail_with = fail_with

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        if key in self.store and not allow_overwrite:
            raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.store[key] = value

    def key_value_try_get(self, key: str) -> str:
        if key not in self.store:
            raise jax.errors.JaxRuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.store[key]

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        self.waited_ms.append(timeout_ms)
        if self._fail_with is not None:
            raise jax.errors.JaxRuntimeError(self._fail_with)
        if key not in self.store:
            time.sleep(timeout_ms / 1000)
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}")
        return self.store[key]

    def key_value_increment(self, key: str, amount: int) -> int:
        self.store[key] = str(int(self.store.get(key, "0")) + amount)
        return int(self.store[key])

    def key_value_dir_get(self, directory: str) -> list[tuple[str, str]]:
        return [(key, value) for key, value in self.store.items() if key.startswith(directory)]

    def key_value_delete(self, key: str) -> None:
        self.store = {k: v for k, v in self.store.items() if not (k == key or k.startswith(f"{key}/"))}


def _named_client_calls(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """`file:line: name` for each attribute or name of `CLIENT_METHODS` that `path` uses: a call,
    or a method taken to call later."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        name = (
            node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        )
        if name in CLIENT_METHODS:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_only_the_coordination_module_talks_to_the_coordination_service():
    offenders = [
        line
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED
        for line in _named_client_calls(path)
    ]
    assert not offenders, "call these through jaxstrategy._src.cluster.coordination:\n" + "\n".join(offenders)


def test_the_scan_finds_a_direct_call(tmp_path):
    offender = tmp_path / "offender.py"
    offender.write_text("def f(client):\n    return client.key_value_try_get('k')\n")
    assert _named_client_calls(offender, tmp_path) == ["offender.py:2: key_value_try_get"]


def test_a_value_set_is_read_and_a_missing_one_is_none_after_the_timeout():
    client = _Client()
    store = KeyValueStore(client)
    store.set("a/b", "42")
    assert store.get_within("a/b", 10) == "42"
    assert store.get_within("a/missing", 10) is None
    assert client.waited_ms == [10, 10]
    assert store.get_now("a/b") == "42" and store.get_now("a/missing") is None


def test_any_other_error_of_the_service_is_raised():
    store = KeyValueStore(_Client(fail_with="UNAVAILABLE: the coordination service is gone"))
    with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
        store.get_within("a/b", 250)


def test_set_once_tells_whether_this_call_set_the_key():
    store = KeyValueStore(_Client())
    assert store.set_once("k", "first") is True
    assert store.set_once("k", "second") is False
    assert store.get_now("k") == "first"
    store.set("k", "third", overwrite=True)
    assert store.get_now("k") == "third"


def test_a_wait_ends_with_the_value_at_a_stop_at_its_deadline_or_by_an_interrupt():
    client = _Client()
    store = KeyValueStore(client)
    threading.Timer(0.05, client.key_value_set, ("late", "here")).start()
    assert store.wait_for("late", poll_ms=20) == "here"
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    assert store.wait_for("never", stop=stop, poll_ms=20) is None
    assert store.wait_for("never", deadline=time.monotonic() + 0.05, poll_ms=20) is None

    def posted_error() -> None:
        raise ValueError("another process failed")

    with pytest.raises(ValueError, match="another process failed"):
        store.wait_for("never", poll_ms=20, interrupt=posted_error)


def test_namespaces_count_per_kind_and_operations_are_counted_by_kind():
    first, second = coordination.new_namespace("test-kind"), coordination.new_namespace("test-kind")
    assert first.startswith("jaxstrategy/test-kind/") and first != second
    counts = coordination.count_operations()
    try:
        store = KeyValueStore(_Client())
        store.set(f"{first}/a", "1")
        store.increment(f"{first}/n", 1)
        store.values_under(f"{first}/")
        store.delete(first)
        assert counts.snapshot() == {"test-kind": {"delete": 1, "dir_get": 1, "increment": 1, "set": 1}}
        assert counts.total("test-kind") == 4 and counts.total() == 4
    finally:
        coordination._counts = None


def test_one_process_agrees_with_itself_and_leaves_no_keys(monkeypatch):
    client = _Client()
    monkeypatch.setattr(coordination, "coordination_client", lambda: client)
    coordination.require_same_on_every_process("f32[3]", what="the results", caller="f()", timeout_s=1)
    assert client.store == {}
