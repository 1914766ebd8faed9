"""The coordination service's helpers, against a stand-in for JAX's client (one process).

Jobs of several processes use them for real in tests/strategies/test_multi_worker.py,
tests/input/test_agreement.py and tests/checkpoint/test_preemption.py.
"""

from __future__ import annotations

import jax
import pytest

from jaxstrategy._src.cluster import coordination


class _Client:
    """The key-value part of JAX's coordination client, in memory, with its timeout error."""

    def __init__(self, fail_with: str | None = None):
        self.store: dict[str, str] = {}
        self.waited_ms: list[int] = []
        self._fail_with = fail_with

    def key_value_set(self, key: str, value: str) -> None:
        self.store[key] = value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        self.waited_ms.append(timeout_ms)
        if self._fail_with is not None:
            raise jax.errors.JaxRuntimeError(self._fail_with)
        if key not in self.store:
            raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: Barrier timed out. Key: {key}")
        return self.store[key]

    def key_value_increment(self, key: str, amount: int) -> int:
        self.store[key] = str(int(self.store.get(key, "0")) + amount)
        return int(self.store[key])

    def key_value_delete(self, key: str) -> None:
        self.store = {k: v for k, v in self.store.items() if not k.startswith(key)}


def test_a_value_set_is_read_and_a_missing_one_is_none_after_the_timeout():
    client = _Client()
    client.key_value_set("a/b", "42")
    assert coordination.value_when_set(client, "a/b", 250) == "42"
    assert coordination.value_when_set(client, "a/missing", 250) is None
    assert client.waited_ms == [250, 250]


def test_any_other_error_of_the_service_is_raised():
    client = _Client(fail_with="UNAVAILABLE: the coordination service is gone")
    with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
        coordination.value_when_set(client, "a/b", 250)


def test_one_process_agrees_with_itself_and_leaves_no_keys(monkeypatch):
    client = _Client()
    monkeypatch.setattr(coordination, "coordination_client", lambda: client)
    coordination.require_same_on_every_process("f32[3]", what="the results", caller="f()", timeout_s=1)
    assert client.store == {}
