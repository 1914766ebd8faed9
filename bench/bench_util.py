"""Helpers shared by the benchmarks (each script puts bench/ on sys.path when run as a file)."""

from __future__ import annotations

import collections
from typing import Any

import jax


def count_compiles() -> collections.Counter[str]:
    """Count XLA backend compiles from now on: a compile inside a timed pass would distort it,
    and a recompile that is not a retrace is caught too."""
    compiles: collections.Counter[str] = collections.Counter()

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles["backend"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    return compiles
