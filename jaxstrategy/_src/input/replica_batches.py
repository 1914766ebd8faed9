"""Host batches laid out for the replicas: split or grouped into equal parts, one part each.

One SPMD program runs on every replica, so every replica's part of a batch must have the same
shape. The parts are taken as TensorFlow takes them (`split`, `consecutive` or `zip`: see
docs/internals.md, "Input") and stacked along a new leading axis for one sharded `device_put`;
what cannot be made equal follows `InputOptions.partial_batch`. A strategy describes its replicas
to the input as a `ReplicaLayout`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import numpy as np

Grouping = Literal["split", "consecutive", "zip"]


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """How a strategy lays each batch out over its replicas.

    Attributes:
      sharding: where a batch goes: the device, or the mesh's replica axis for stacked batches.
      num_replicas: how many replicas share each batch.
      stacked: whether batches are split per replica, stacked along a new leading axis and
        delivered as `PerReplica` leaves (False only for one replica: the batch as it is).
      local_replicas: the ids of the replicas this process holds devices of, consecutive;
        None means all.
      input_timeout_s: with several processes, how long a process's input waits for the
        others' at one step.
      is_multi_process: whether `sharding`'s devices belong to several processes: then each
        process places only its own devices' parts of its replicas' batches, and the
        processes' inputs end together (see `input/agreement.py`). True also where this
        process holds (a part of) every replica: one replica of a `MultiWorkerShardedStrategy`
        split over several processes.
    """

    sharding: jax.sharding.Sharding
    num_replicas: int = 1
    stacked: bool = False
    local_replicas: range | None = None
    input_timeout_s: float = 3600.0
    is_multi_process: bool = False

    @property
    def local_replica_ids(self) -> range:
        return range(self.num_replicas) if self.local_replicas is None else self.local_replicas


@dataclasses.dataclass(frozen=True)
class HostElement:
    """One element of a source: its leaves and their structure. The leaves are numpy arrays
    (private copies), or for a layout that is not stacked, jax arrays as the source gave them."""

    leaves: list[np.ndarray | jax.Array]
    treedef: Any


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """What one step receives, not yet placed.

    Attributes:
      leaves: the batch's leaves, as `HostElement`'s; when stacked, each has a new leading axis,
        one entry per replica.
      treedef: the batch's structure.
      mask: with `partial_batch='pad'`, True for real examples (stacked like the leaves).
    """

    leaves: Sequence[np.ndarray | jax.Array]
    treedef: Any
    mask: np.ndarray | None


@dataclasses.dataclass(frozen=True)
class DroppedBatch:
    """Stands in the stream for batches not delivered: one dropped under `partial_batch='drop'`,
    or those left unread where processes' inputs end at different steps. Carries the warning."""

    message: str


class ReplicaBatcher:
    """Turns the host elements of one pass into `HostBatch`es for `num_replicas` replicas.

    Args:
      num_replicas: how many replicas share each batch.
      local_replicas: the ids of this process's replicas (consecutive), whose parts it lays out;
        None for all. With `split` every process reads the same global batches and keeps its
        replicas' parts; otherwise this process's pipelines supply its replicas alone.
      grouping: how replicas take their parts (`split`, `consecutive` or `zip`; see
        docs/internals.md, "Input").
      stacked: stack the parts along a new leading axis (False only for one replica, whose
        batch is then passed on as it is).
      partial_batch: 'error', 'drop' or 'pad' (see `InputOptions.partial_batch`).
      caller: the call to name in messages.
    """

    def __init__(
        self,
        *,
        num_replicas: int,
        grouping: Grouping,
        stacked: bool,
        partial_batch: str,
        caller: str,
        local_replicas: range | None = None,
    ):
        if not stacked and (num_replicas != 1 or grouping != "split"):
            raise ValueError("Unstacked batches are for a single replica that takes whole batches.")
        self._n = num_replicas
        self._local = range(num_replicas) if local_replicas is None else local_replicas
        self._grouping = grouping
        self._stacked = stacked
        self._policy = partial_batch
        self._caller = caller

    def batches(self, passes: list[Iterator[HostElement]]) -> Iterator[HostBatch | DroppedBatch]:
        """Lay out the elements of `passes` (one iterator per input pipeline) batch by batch."""
        if self._grouping == "split":
            (elements,) = passes
            for element in elements:
                yield self._split(element)
            return
        if self._grouping == "consecutive":
            (elements,) = passes
            groups: Iterator[Sequence[HostElement | None]] = _chunks(elements, len(self._local))
        else:
            groups = _zip_until_one_ends(passes)
        for group in groups:
            yield self._stack(group)

    def _split(self, element: HostElement) -> HostBatch | DroppedBatch:
        pad = self._policy == "pad"
        if not self._stacked:  # One replica takes each batch whole.
            if not pad:
                return HostBatch(element.leaves, element.treedef, None)
            size = _batch_size(element)
            return HostBatch(element.leaves, element.treedef, np.ones(() if size is None else (size,), bool))
        size = _batch_size(element)
        if size is None and self._n == 1:  # One replica takes the element whole, as one device does.
            mask = np.ones((1,), bool) if pad else None
            return HostBatch([leaf[None] for leaf in element.leaves], element.treedef, mask)
        if size is None:
            raise ValueError(
                f"{self._caller}: a strategy with {self._n} replicas splits each batch along its "
                "first axis, but this element has a scalar leaf or leaves of different lengths "
                f"({_describe_shapes(element)}). Batch the dataset (every leaf with the same "
                "leading batch size), or build per-replica elements with "
                "distribute_datasets_from_function."
            )
        per_replica = math.ceil(size / self._n)
        if size % self._n:
            what = f"a batch of {size} examples, which does not split evenly over {self._n} replicas"
            fix = (
                f"Make the batch size a multiple of {self._n} and drop the remainder in the source "
                "(as drop_remainder=True does)"
            )
            dropped = self._tolerate(what, fix, dropped=size)
            if dropped is not None:
                return dropped
        padded = per_replica * self._n
        rows = slice(self._local.start, self._local.stop)  # This process's replicas' parts.
        leaves = [
            _pad_to(leaf, padded).reshape(self._n, per_replica, *leaf.shape[1:])[rows]
            for leaf in element.leaves
        ]
        mask = (np.arange(padded) < size).reshape(self._n, per_replica)[rows] if pad else None
        return HostBatch(leaves, element.treedef, mask)

    def _stack(self, group: Sequence[HostElement | None]) -> HostBatch | DroppedBatch:
        """Stack one element per local replica; None, or a group shorter than them, is missing."""
        count = len(self._local)
        group = [*group, *[None] * (count - len(group))]
        present = [element for element in group if element is not None]
        first = present[0]
        for element in present[1:]:
            if element.treedef != first.treedef:
                raise ValueError(
                    f"{self._caller}: the elements that make up one step differ in structure: "
                    f"{first.treedef} and {element.treedef}. Every element must have the same "
                    "structure."
                )
        batch_sizes = [_batch_size(element) for element in present]
        unbatched = None in batch_sizes
        sizes = [size or 0 for size in batch_sizes]
        trailing = [[leaf.shape[0 if unbatched else 1 :] for leaf in e.leaves] for e in present]
        if any(shapes != trailing[0] for shapes in trailing):
            raise ValueError(
                f"{self._caller}: the elements that make up one step have different shapes "
                f"({'; '.join(_describe_shapes(e) for e in present)}). Only the first (batch) axis "
                "may differ, and only with InputOptions(partial_batch='pad')."
            )
        if len(present) < count:
            replicas = f"{count} replicas" if count == self._n else f"{count} replicas of this process"
            what = f"{len(present)} element(s) for the {replicas} at the end of the data"
        elif not unbatched and len(set(sizes)) > 1:
            what = f"elements of different batch sizes {sizes} for one step"
        else:
            what = ""
        if what:
            takes = (
                f"Each step takes {count} consecutive elements, one per replica, each a whole "
                "per-replica batch"
                if self._grouping == "consecutive"
                else f"Each step takes one element from each of the {count} pipelines, one per replica"
            )
            fix = (
                f"{takes}: batch at the per-replica size (InputContext.get_per_replica_batch_size) with "
                "drop_remainder=True, and give every replica as many elements"
            )
            dropped = self._tolerate(what, fix, dropped=len(present) if unbatched else sum(sizes))
            if dropped is not None:
                return dropped
        length = None if unbatched else max(sizes)
        missing = [np.zeros_like(_pad_to(leaf, length)) for leaf in first.leaves]
        leaves = [
            np.stack([missing[i] if e is None else _pad_to(e.leaves[i], length) for e in group])
            for i in range(len(first.leaves))
        ]
        if self._policy != "pad":
            return HostBatch(leaves, first.treedef, None)
        if unbatched:
            mask = np.array([e is not None for e in group])
        else:
            mask = np.zeros((count, max(sizes)), bool)
            for replica, part in enumerate(group):
                if part is not None:
                    mask[replica, : _batch_size(part)] = True
        return HostBatch(leaves, first.treedef, mask)

    def _tolerate(self, what: str, fix: str, *, dropped: int) -> DroppedBatch | None:
        """Apply the partial-batch policy to `what`: raise (saying `fix`), drop it (a
        `DroppedBatch`), or pad it (None: go on)."""
        if self._policy == "pad":
            return None
        if self._policy == "drop":
            return DroppedBatch(
                f"{self._caller}: dropped {what} ({dropped} example(s)), as "
                "InputOptions(partial_batch='drop') asks."
            )
        raise ValueError(
            f"{self._caller}: got {what}. Every replica runs the same program on the same shapes, so "
            f"each step needs equal parts for all {self._n} replicas. {fix}; or pass "
            "InputOptions(partial_batch='drop') to skip such batches with a warning, or "
            "partial_batch='pad' to pad them with zeros and get a mask of the real examples."
        )


def _batch_size(element: HostElement) -> int | None:
    """The common length of the leaves' first axes, or None for a scalar leaf or unequal lengths."""
    sizes = {leaf.shape[0] if leaf.ndim else None for leaf in element.leaves}
    if len(sizes) != 1:
        return None
    return sizes.pop()


def _pad_to(leaf: np.ndarray | jax.Array, length: int | None) -> Any:
    """`leaf` padded with zeros along axis 0 to `length` (None: unchanged)."""
    if length is None or leaf.shape[0] == length:
        return leaf
    padding = np.zeros((length - leaf.shape[0], *leaf.shape[1:]), leaf.dtype)
    return np.concatenate([leaf, padding])


def _describe_shapes(element: HostElement) -> str:
    shapes = [f"{leaf.dtype.name}{list(leaf.shape)}" for leaf in element.leaves]
    return ", ".join(shapes) or "no leaves"


def _chunks(elements: Iterator[HostElement], size: int) -> Iterator[list[HostElement]]:
    while chunk := list(itertools.islice(elements, size)):
        yield chunk


def _zip_until_one_ends(passes: list[Iterator[HostElement]]) -> Iterator[list[HostElement | None]]:
    """One element from each pass per step (None where a pass has ended); a step where some pass
    has ended is the last."""
    while True:
        group = [next(elements, None) for elements in passes]
        if all(element is None for element in group):
            return
        yield group
        if None in group:
            return
