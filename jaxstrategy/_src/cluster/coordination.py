"""JAX's coordination service, as jaxstrategy uses it: waiting for a key, and agreeing on a value.

Every process of a `jax.distributed` job reaches one key-value store through its coordinator
(process 0). These are the generic pieces the library's protocols build on: the input
agreement (`input/agreement.py`), the checkpoint lock's job-wide acquire, preemption, and the
check that a cross-process value has the same shape everywhere.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax

from jaxstrategy._src.core.jax_compat import coordination_client


def value_when_set(client: Any, key: str, timeout_ms: int) -> str | None:
    """The value of `key` in the coordination service's store once some process sets it, or None
    if none does within `timeout_ms`. Any other error of the service (it is gone, say) is raised."""
    try:
        return str(client.blocking_key_value_get(key, timeout_ms))
    except jax.errors.JaxRuntimeError as error:
        if "DEADLINE_EXCEEDED" not in str(error):
            raise
        return None


_value_serials = itertools.count()


def every_process_value(value: str, *, caller: str, timeout_s: float) -> dict[int, str]:
    """Post `value` and return every process's, by process index: a gather through the service.

    Each process writes its value under a key of its own (the calls' order, the same on every
    process, names the call), reads the others', and the last to read deletes the call's keys.

    Raises:
      TimeoutError: some process did not make this call within `timeout_s`.
    """
    client = coordination_client()
    n, me = jax.process_count(), jax.process_index()
    namespace = f"jaxstrategy/values/{next(_value_serials)}"
    client.key_value_set(f"{namespace}/signature/{me}", value)
    values = {}
    for process in range(n):
        found = value_when_set(client, f"{namespace}/signature/{process}", int(timeout_s * 1000))
        if found is None:
            raise TimeoutError(
                f"{caller}: process {me} waited {timeout_s:.0f} s for process {process} to make the "
                "same call. Every process must make the same calls in the same order."
            )
        values[process] = found
    if client.key_value_increment(f"{namespace}/done", 1) == n:
        client.key_value_delete(namespace)
    return values


def require_same_on_every_process(signature: str, *, what: str, caller: str, timeout_s: float) -> None:
    """Raise a ValueError on every process unless all of them pass the same `signature`.

    Raises:
      ValueError: the signatures differ; the message lists each process's.
      TimeoutError: some process did not make this call within `timeout_s`.
    """
    signatures = every_process_value(signature, caller=caller, timeout_s=timeout_s)
    if len(set(signatures.values())) > 1:
        lines = "".join(f"\n  process {process}: {s}" for process, s in sorted(signatures.items()))
        raise ValueError(
            f"{caller}: {what} differ between processes in structure, shape or dtype, so they cannot "
            f"make one value over every replica (one program runs on all of them):{lines}\nMake every "
            "process's results the same shape and dtype."
        )
