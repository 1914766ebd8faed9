"""Batches placed on a strategy's device(s), and what their shapes tell a dataset.

`BatchPlacer` puts a `HostBatch` (see `replica_batches.py`) where the strategy wants it, in the
producer thread, and records its signature there (structure, shapes and dtypes: what decides
whether a step recompiles), off the step's path. A dataset's `BatchTracker` reads the signatures
of the batches the user takes: the first gives the element spec, and a change of shape mid-stream
is worth one warning.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from jaxstrategy._src.core.errors import caller_stacklevel
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.input.replica_batches import DroppedBatch, HostBatch, ReplicaLayout
from jaxstrategy._src.values.per_replica import PerReplica
from jaxstrategy._src.values.variables import device_put_anywhere, put_private


@dataclasses.dataclass(frozen=True)
class _Signature:
    """The structure, shapes and dtypes of a batch: what decides whether a step recompiles."""

    treedef: Any
    shapes_and_dtypes: tuple[tuple[tuple[int, ...], np.dtype], ...]


@dataclasses.dataclass(frozen=True)
class PlacedBatch:
    """A placed batch and its signature (computed in the producer thread, off the hot path), and
    the source's own jax arrays it holds as they were (see `require_not_donated`)."""

    value: PyTree
    signature: _Signature
    as_given: tuple[jax.Array, ...] = ()

    def require_not_donated(self) -> None:
        """Raise if a step donated one of the source's arrays this batch holds: the source hands
        out the same arrays at every pass. Asked in the consumer's thread, when the batch is taken,
        since a step deletes what it donates when it is dispatched (batches placed ahead were
        placed before)."""
        if any(array.is_deleted() for array in self.as_given):
            raise ValueError(
                "A batch of this distributed dataset holds an array that was deleted: a jax array "
                "already on the strategy's device is delivered as it is, and a step donated it "
                "(RunOptions(donate_argnums=...) naming the batch). Such a batch belongs to the "
                "dataset: donate only the state, not the batch, or give the dataset numpy arrays."
            )


class BatchPlacer:
    """Puts a `HostBatch` on `layout.sharding` (or keeps it on the host when `on_device` is False).

    Stacked leaves (and the mask) are wrapped in `PerReplica`; a mask makes the batch a
    `(batch, mask)` pair.
    """

    def __init__(self, layout: ReplicaLayout, *, on_device: bool):
        self._layout = layout
        self._on_device = on_device

    def __call__(self, batch: HostBatch | DroppedBatch) -> PlacedBatch | DroppedBatch:
        if isinstance(batch, DroppedBatch):
            return batch  # Passed on for the consumer to warn about.
        leaves = batch.leaves if batch.mask is None else [*batch.leaves, batch.mask]
        placed: Sequence[Any] = self._place(leaves) if self._on_device else [np.asarray(x) for x in leaves]
        # Every leaf is an array by now (jax, or numpy on the host): it has a shape and a dtype.
        signature = _Signature(batch.treedef, tuple((x.shape, x.dtype) for x in placed))
        as_given = tuple(
            x for x, leaf in zip(placed, leaves, strict=True) if x is leaf and isinstance(x, jax.Array)
        )
        if self._layout.stacked:
            placed = [PerReplica(x) for x in placed]
        value = jax.tree.unflatten(batch.treedef, placed[: len(batch.leaves)])
        if batch.mask is not None:
            value = (value, placed[-1])
        return PlacedBatch(value, signature, as_given)

    def _place(self, leaves: Sequence[np.ndarray | jax.Array]) -> Sequence[Any]:
        sharding = self._layout.sharding
        if self._layout.is_multi_process:
            # This process holds its own replicas' rows; JAX assembles the global array from them.
            n = self._layout.num_replicas
            return [
                jax.make_array_from_process_local_data(sharding, leaf, (n, *leaf.shape[1:]))
                for leaf in leaves
            ]
        if isinstance(sharding, jax.sharding.SingleDeviceSharding) and not any(
            isinstance(leaf, jax.Array) for leaf in leaves
        ):
            return list(_one_device_placer(sharding)(*leaves))
        # Jax arrays already placed as the step wants them are used as they are, at no cost: the
        # recipe for data that fits on the device (see the performance guide). Numpy leaves are
        # private copies, which JAX may take over; a jax array that moves is copied, so that a
        # step donating its batch cannot delete the source's array.
        placed = list(leaves)
        on_host, elsewhere = [], []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, jax.Array):
                on_host.append(i)
            elif getattr(leaf, "weak_type", False):
                # Typed on the device, as numpy types it on every other path (`jnp.array(0.5)`
                # becomes float32): kept weak, its dtype would follow what the step combines it with.
                typed = placed[i] = leaf.astype(leaf.dtype)
                if not _is_placed(typed, sharding):
                    elsewhere.append(i)
            elif not _is_placed(leaf, sharding):
                elsewhere.append(i)
        if on_host:
            for i, leaf in zip(on_host, put_private([leaves[i] for i in on_host], sharding), strict=True):
                placed[i] = leaf
        if elsewhere:
            copies = device_put_anywhere([placed[i] for i in elsewhere], sharding, may_alias=False)
            for i, leaf in zip(elsewhere, copies, strict=True):
                placed[i] = leaf
        return placed


@functools.lru_cache(maxsize=16)
def _one_device_placer(sharding: jax.sharding.Sharding) -> Callable[..., tuple[jax.Array, ...]]:
    """Places host leaves on one device: a compiled identity, since `jax.device_put` spends its
    time in Python on a batch, where a jitted call hands its numpy arguments to JAX's C++ dispatch
    (docs/performance.md, "The input pipeline", compares them). Its outputs are XLA's own buffers,
    never views of the host arrays. Over a mesh, `device_put` stays faster: the jitted call would
    place every input whole."""
    return jax.jit(lambda *leaves: leaves, out_shardings=sharding)


def _is_placed(leaf: jax.Array, sharding: jax.sharding.Sharding) -> bool:
    return leaf.committed and leaf.sharding == sharding


class BatchTracker:
    """What the passes over one dataset learn from its batches: the element spec, and whether
    shapes change mid-stream (worth one warning per dataset)."""

    def __init__(self, sharding: jax.sharding.Sharding | None):
        self._sharding = sharding
        self.element_spec: PyTree | None = None
        self._first: _Signature | None = None
        self._warned = False

    def record(self, batch: PlacedBatch) -> None:
        if self.element_spec is None:
            self._first = batch.signature
            self.element_spec = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._sharding),
                batch.value,
            )

    def differs(self, batch: PlacedBatch, *, previous_differed: bool) -> bool:
        """Record `batch`; warn if the batch before it changed shape; return whether this one did.

        A new shape recompiles the step. A different last batch (a partial one) costs one compile
        and is normal, so only a changed batch followed by more batches is worth a warning.
        """
        self.record(batch)
        if previous_differed and not self._warned:
            self._warned = True
            warnings.warn(
                "The batches of this distributed dataset change shape or dtype mid-stream "
                f"(first: {_describe(self._first)}). Each new shape compiles the step function anew. "
                "Pad or bucket batches to a few fixed shapes.",
                stacklevel=caller_stacklevel(),
            )
        return batch.signature != self._first


def _describe(signature: _Signature | None) -> str:
    if signature is None:
        return "none"
    return ", ".join(f"{dtype.name}{list(shape)}" for shape, dtype in signature.shapes_and_dtypes)
