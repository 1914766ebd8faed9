"""Shared type aliases and protocols."""

from __future__ import annotations

import contextlib
from typing import Any, Protocol, TypeAlias

import jax

PyTree: TypeAlias = Any
"""Any JAX pytree: nested tuples, lists, dicts and registered nodes with arrays as leaves."""

DeviceLike: TypeAlias = "str | int | jax.Device | None"
"""What a strategy accepts as a device: '/gpu:0', 'cpu', 'cuda:1', an index, a `jax.Device`."""


class StepFn(Protocol):
    """A step function passed to `Strategy.run`: arrays in, a pytree of arrays out."""

    def __call__(self, *args: Any, **kwargs: Any) -> PyTree: ...


class StrategyLike(Protocol):
    """What the rooms below `strategies/` know of a strategy; `Strategy` is what implements it.

    `values/contexts.py` keeps the current strategy and builds replica contexts, but may not
    import `Strategy` (imports point down, and `Strategy` imports the contexts); it needs only this.
    """

    @property
    def num_replicas_in_sync(self) -> int: ...

    @property
    def devices(self) -> tuple[jax.Device, ...]: ...

    def _default_device_scope(self) -> contextlib.AbstractContextManager[Any]: ...
