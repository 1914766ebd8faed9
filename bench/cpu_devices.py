"""Forcing a benchmark's number of CPU devices: a module of its own, since it must run before JAX
is imported, and bench_util imports JAX."""

from __future__ import annotations

import os
import re


def force_cpu_devices(count: int) -> None:
    """Have XLA's CPU backend make `count` devices (`XLA_FLAGS`), unless XLA_FLAGS already forces
    a count. Call it before JAX is imported: XLA reads its flags once, when JAX starts."""
    if not re.search(r"device_count=\d", os.environ.get("XLA_FLAGS", "")):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
        ).strip()
