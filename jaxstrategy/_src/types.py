"""Shared type aliases and protocols."""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import jax

PyTree: TypeAlias = Any
"""Any JAX pytree: nested tuples, lists, dicts and registered nodes with arrays as leaves."""

DeviceLike: TypeAlias = "str | int | jax.Device | None"
"""What a strategy accepts as a device: '/gpu:0', 'cpu', 'cuda:1', an index, a `jax.Device`."""


class StepFn(Protocol):
    """A step function passed to `Strategy.run`: arrays in, a pytree of arrays out."""

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree: ...
