"""Distributed datasets: any host iterable of batches, prefetched onto a strategy's device(s).

`DistributedDataset` wraps a source; each `iter()` starts a fresh pass: a `DistributedIterator`
whose `PrefetchIterator` reads the source in a background thread and places each batch with the
`put` it is given. Sources are read through `host_passes`, which knows lists, iterables,
`tf.data.Dataset` (through `as_numpy_iterator`), torch `DataLoader` and Grain loaders without
importing any of them.

Each batch travels with its sources' positions after it (see `iterator_state.py`), so that
`DistributedIterator.get_state` counts what the user took, not what the thread read ahead, and
`set_state` starts the pass again from there.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxstrategy._src import contexts
from jaxstrategy._src.errors import (
    JaxStrategyError,
    StrategyContextError,
    bullet_list,
    caller_stacklevel,
    format_path,
)
from jaxstrategy._src.input_agreement import StepAgreement, agreed_steps, new_dataset_namespace
from jaxstrategy._src.iterator_state import (
    PassPosition,
    SourceMark,
    SourceReader,
    is_stateful,
    resume_sources,
)
from jaxstrategy._src.options import InputOptions
from jaxstrategy._src.per_replica import PerReplica
from jaxstrategy._src.prefetch import PrefetchIterator
from jaxstrategy._src.replica_batches import DroppedBatch, Grouping, HostBatch, HostElement, ReplicaBatcher
from jaxstrategy._src.tree_checks import is_array_like, is_wide_host_leaf, require_representable
from jaxstrategy._src.types import PyTree
from jaxstrategy._src.variables import private_copy, put_private

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2
# How long `set_state` waits for the input thread to finish reading a one-shot iterator.
_ONE_SHOT_JOIN_S = 60.0


class OutOfRangeError(JaxStrategyError):
    """`DistributedIterator.get_next()` was called after the last element."""


@dataclasses.dataclass(frozen=True)
class _Signature:
    """The structure, shapes and dtypes of a batch: what decides whether a step recompiles."""

    treedef: Any
    shapes_and_dtypes: tuple[tuple[tuple[int, ...], np.dtype], ...]


@dataclasses.dataclass(frozen=True)
class _Batch:
    """A placed batch and its signature (computed in the producer thread, off the hot path)."""

    value: PyTree
    signature: _Signature


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """How a strategy lays each batch out over its replicas.

    Attributes:
      sharding: where a batch goes: the device, or the mesh's replica axis for stacked batches.
      num_replicas: how many replicas share each batch.
      stacked: whether batches are split per replica, stacked along a new leading axis and
        delivered as `PerReplica` leaves (False only for one replica: the batch as it is).
      local_replicas: the ids of this process's replicas, consecutive; None means all. When
        some replicas belong to other processes, each process places only its own replicas'
        parts, and the processes' inputs end together (see `input_agreement.py`).
      input_timeout_s: then, how long a process's input waits for the others' at one step.
    """

    sharding: jax.sharding.Sharding
    num_replicas: int = 1
    stacked: bool = False
    local_replicas: range | None = None
    input_timeout_s: float = 3600.0

    @property
    def local_replica_ids(self) -> range:
        return range(self.num_replicas) if self.local_replicas is None else self.local_replicas

    @property
    def is_multi_process(self) -> bool:
        return len(self.local_replica_ids) < self.num_replicas


def host_elements(source: Iterator[Any]) -> Iterator[HostElement]:
    """The elements of `source` as numpy leaves, each copied once.

    Leaves become numpy arrays first (anything with `__array__` or `.numpy()`: torch and
    TensorFlow tensors included). Each is copied (see `variables.private_copy`), so a source that
    refills one buffer for every batch cannot change batches already delivered; JAX then uses the
    copy without copying again.

    Raises:
      TypeError: a leaf cannot be an array; every such leaf is named by its path.
      OverflowError: a leaf's values do not fit JAX's 32-bit types (x64 off); each is named.
    """
    for element in source:
        leaves, treedef = jax.tree.flatten(element)
        host = [_to_host_array(leaf) for leaf in leaves]
        bad = [i for i, leaf in enumerate(host) if leaf is None]
        if bad:
            raise TypeError(_describe_bad_leaves(element, bad))
        # Only 64-bit numpy leaves and Python ints can hold what 32 bits cannot.
        if any(type(leaf) is int or is_wide_host_leaf(leaf) for leaf in host):
            # Raised at the step this element belongs to, as any error of the source.
            require_representable(
                jax.tree.unflatten(treedef, host), caller="the distributed dataset", name="element"
            )
        yield HostElement([np.asarray(private_copy(leaf)) for leaf in host], treedef)


class BatchPlacer:
    """Puts a `HostBatch` on `layout.sharding` (or keeps it on the host when `on_device` is False).

    Stacked leaves (and the mask) are wrapped in `PerReplica`; a mask makes the batch a
    `(batch, mask)` pair.
    """

    def __init__(self, layout: ReplicaLayout, *, on_device: bool):
        self._layout = layout
        self._on_device = on_device

    def __call__(self, batch: HostBatch | DroppedBatch) -> _Batch | DroppedBatch:
        if isinstance(batch, DroppedBatch):
            return batch  # Passed on for the consumer to warn about.
        leaves = batch.leaves if batch.mask is None else [*batch.leaves, batch.mask]
        placed: list[Any] = self._place(leaves) if self._on_device else leaves
        signature = _Signature(batch.treedef, tuple((tuple(np.shape(x)), _dtype_of(x)) for x in placed))
        if self._layout.stacked:
            placed = [PerReplica(x) for x in placed]
        value = jax.tree.unflatten(batch.treedef, placed[: len(batch.leaves)])
        if batch.mask is not None:
            value = (value, placed[-1])
        return _Batch(value, signature)

    def _place(self, leaves: list[np.ndarray]) -> list[jax.Array]:
        if isinstance(self._layout.sharding, jax.sharding.SingleDeviceSharding):
            return list(_one_device_placer(self._layout.sharding)(*leaves))
        if not self._layout.is_multi_process:
            return put_private(leaves, self._layout.sharding)
        # This process holds its own replicas' rows; JAX assembles the global array from them.
        n = self._layout.num_replicas
        return [
            jax.make_array_from_process_local_data(self._layout.sharding, leaf, (n, *leaf.shape[1:]))
            for leaf in leaves
        ]


@functools.lru_cache(maxsize=16)
def _one_device_placer(sharding: jax.sharding.Sharding) -> Callable[..., tuple[jax.Array, ...]]:
    """Places host leaves on one device: a compiled identity, since `jax.device_put` spends ~100 us
    of Python on a batch, where a jitted call hands its numpy arguments to JAX's C++ dispatch
    (measured, a 128x784 float32 batch and its labels: 202 us a batch through the whole pipeline,
    115 us this way). Its outputs are XLA's own buffers, never views of the host arrays. Over a
    mesh, `device_put` stays faster: the jitted call would place every input whole."""
    return jax.jit(lambda *leaves: leaves, out_shardings=sharding)


def _to_host_array(leaf: Any) -> Any:
    """The leaf as an array JAX accepts, or None when it cannot be one."""
    if is_array_like(leaf):
        return leaf
    if hasattr(leaf, "__array__"):
        array = np.asarray(leaf)
    elif callable(getattr(leaf, "numpy", None)):
        array = np.asarray(leaf.numpy())
    else:
        return None
    return array if is_array_like(array) else None


def _dtype_of(leaf: Any) -> np.dtype:
    return np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else np.asarray(leaf).dtype


def _describe_bad_leaves(element: PyTree, positions: list[int]) -> str:
    paths = jax.tree_util.tree_flatten_with_path(element)[0]
    lines = [f"{format_path('batch', paths[i][0])} is a {type(paths[i][1]).__name__}" for i in positions]
    return (
        "Every leaf of a dataset element must be a numeric array (numpy, jax, or anything with "
        f"__array__ or .numpy()), but:{bullet_list(lines)}\nDrop those fields before distributing the "
        "dataset, or encode them as numbers."
    )


def host_passes(dataset: Any, *, caller: str) -> tuple[Callable[[], Iterator[Any]], bool]:
    """Return a function that starts a new pass over `dataset`, and whether it is one-shot.

    Raises:
      TypeError: `dataset` is not iterable.
    """
    as_numpy = getattr(dataset, "as_numpy_iterator", None)
    if callable(as_numpy):  # tf.data.Dataset: its elements as numpy, without importing TensorFlow.
        return as_numpy, False
    if isinstance(dataset, Mapping):
        raise TypeError(
            f"{caller}: the dataset is a {type(dataset).__name__}, whose iteration yields its keys. "
            "Pass a list of batches (each batch may be a dict), or a generator of them; to slice "
            "arrays into batches, e.g. [{k: v[i:i + n] for k, v in d.items()} for i in range(0, len, n)]."
        )
    if isinstance(dataset, Iterator):  # A generator object or another one-shot iterator.
        return (lambda: dataset), True
    if isinstance(dataset, Iterable) or hasattr(dataset, "__getitem__"):
        return (lambda: iter(dataset)), False
    raise TypeError(
        f"{caller}: the dataset must be an iterable of batches (a list, a generator, a tf.data "
        f"Dataset, a torch DataLoader, ...); got {type(dataset).__name__}."
    )


# Sources whose elements are already in host memory: reading one is a copy, CPU work.
_IN_MEMORY = (list, tuple, np.ndarray)
_DOUBLE_BUFFER = 2


def _buffer_size(options: InputOptions, layout: ReplicaLayout, sources: list[Any]) -> int:
    """The batches to keep placed ahead: the option's, or when it is None, 2 unless a thread would
    only take cores from the step (CPU devices fed from memory; see `InputOptions`)."""
    if options.experimental_per_replica_buffer_size is not None:
        return options.experimental_per_replica_buffer_size
    on_cpu = all(device.platform == "cpu" for device in layout.sharding.device_set)  # type: ignore[attr-defined]
    # Across processes the thread also runs the processes' agreement on each step (round trips to
    # the coordinator), which it keeps off the step's path.
    if on_cpu and not layout.is_multi_process and all(isinstance(s, _IN_MEMORY) for s in sources):
        return 0
    return _DOUBLE_BUFFER


def cardinality_of(dataset: Any) -> int:
    """The number of elements `dataset` will yield, or TensorFlow's INFINITE/UNKNOWN constants."""
    tf_cardinality = getattr(dataset, "cardinality", None)
    if callable(tf_cardinality):
        return int(tf_cardinality())
    try:
        return len(dataset)
    except TypeError:
        return UNKNOWN_CARDINALITY


def _grouped_cardinality(
    cardinalities: list[int], num_replicas: int, grouping: Grouping, options: InputOptions
) -> int:
    """The number of batches made from sources of these cardinalities, where it is known.

    `num_replicas` is the number of replicas the sources feed: this process's, with `consecutive`.
    """
    if any(c < 0 for c in cardinalities):
        infinite = all(c == INFINITE_CARDINALITY for c in cardinalities)
        return INFINITE_CARDINALITY if infinite else UNKNOWN_CARDINALITY
    if options.partial_batch == "drop" and num_replicas > 1:
        # Which batches are dropped depends on their sizes, which are not known before reading.
        return UNKNOWN_CARDINALITY
    if grouping == "split":
        return cardinalities[0]
    if grouping == "zip":
        shortest, longest = min(cardinalities), max(cardinalities)
        return shortest + (longest > shortest)
    whole, rest = divmod(cardinalities[0], num_replicas)
    return whole + (rest > 0)


class DistributedDataset:
    """A dataset whose batches arrive on the strategy's device(s), prefetched in the background.

    Made by `Strategy.experimental_distribute_dataset` or `distribute_datasets_from_function`.
    Every `iter()` starts a fresh pass over the source with its own background thread. A one-shot
    source (a generator object) allows a single pass; a second is an error, never an empty loop.

    Example:
      >>> import numpy as np, jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy()
      >>> batches = [np.arange(i, i + 2) for i in range(0, 10, 2)]
      >>> dataset = strategy.experimental_distribute_dataset(batches)
      >>> [x.tolist() for x in dataset][:2], len(dataset)
      ([[0, 1], [2, 3]], 5)
    """

    def __init__(
        self,
        sources: list[Any],
        *,
        layout: ReplicaLayout,
        grouping: Grouping,
        options: InputOptions,
        caller: str,
    ):
        on_device = bool(options.experimental_fetch_to_device)
        if layout.is_multi_process and not on_device:
            raise NotImplementedError(
                f"{caller}: InputOptions(experimental_fetch_to_device=False) is not supported across "
                "processes: a process holds only its own replicas' parts, which make no whole batch "
                "on the host. Leave it True, and take host copies with experimental_local_results."
            )
        passes = [host_passes(source, caller=caller) for source in sources]
        self._start_passes = [start for start, _ in passes]
        self._one_shot = any(one_shot for _, one_shot in passes)
        # A one-shot source starts no second pass, so only one with its own state can be restored.
        self._unrestorable = [
            source
            for source, (_, one_shot) in zip(sources, passes, strict=True)
            if one_shot and not is_stateful(source)
        ]
        fed = layout.num_replicas if grouping == "split" else len(layout.local_replica_ids)
        self._cardinality = _grouped_cardinality(
            [cardinality_of(source) for source in sources], fed, grouping, options
        )
        self._options = options
        self._buffer_size = _buffer_size(options, layout, sources)
        self._batcher = ReplicaBatcher(
            num_replicas=layout.num_replicas,
            local_replicas=layout.local_replicas,
            grouping=grouping,
            stacked=layout.stacked,
            partial_batch=options.partial_batch,
            caller=caller,
        )
        self._placer = BatchPlacer(layout, on_device=on_device)
        self._caller = caller
        # Where processes read their own inputs, they agree batch by batch where a pass ends.
        self._agreement_namespace = new_dataset_namespace() if layout.is_multi_process else None
        self._input_timeout_s = layout.input_timeout_s
        # Every pass started, restored ones included: each gets its own agreement namespace.
        self._passes_started = 0
        # The number the next pass gets, which a restored pass moves on.
        self._next_pass_index = 0
        self._next_pass: DistributedIterator | None = None
        self._batches = _BatchTracker(layout.sharding if on_device else None)

    def __iter__(self) -> DistributedIterator:
        if self._next_pass is not None:
            iterator, self._next_pass = self._next_pass, None
            return iterator
        if self._one_shot and self._passes_started:
            raise RuntimeError(
                "This distributed dataset was made from a one-shot iterator (such as a generator "
                "object), which was used up by its first pass. Distribute a re-iterable source "
                "instead: a list, a tf.data Dataset, or an object whose __iter__ starts a new pass."
            )
        position = PassPosition.start(self._next_pass_index, len(self._start_passes))
        readers = [SourceReader(start()) for start in self._start_passes]
        return DistributedIterator(self, self._start_pass(readers, position), position)

    def _start_pass(self, readers: list[SourceReader], position: PassPosition) -> _Pass:
        """A pass over `readers` (the sources, each at its place in `position`), prefetching."""
        self._passes_started += 1
        self._next_pass_index = position.pass_index + 1
        # Reading, copying and laying out batches happen with placement: in the producer thread,
        # or, without one, in the thread that takes the batch.
        batches: Iterator[HostBatch | DroppedBatch] = self._batcher.batches(
            [host_elements(reader) for reader in readers]
        )
        stopped = threading.Event()
        if self._agreement_namespace is not None:
            namespace = f"{self._agreement_namespace}/{self._passes_started}"
            agreement = StepAgreement(
                namespace, stop=stopped, caller=self._caller, timeout_s=self._input_timeout_s
            )
            batches = agreed_steps(batches, agreement, cardinality=self._cardinality, caller=self._caller)
        prefetch = PrefetchIterator(
            _marked(batches, readers),
            self._place_marked,
            self._buffer_size,
            stopped=stopped,
        )
        return _Pass(prefetch, self._batches)

    def _place_marked(self, marked: tuple[HostBatch | DroppedBatch, tuple[SourceMark, ...]]) -> _Marked:
        batch, marks = marked
        return self._placer(batch), marks

    def _resume_pass(self, position: PassPosition, *, caller: str) -> _Pass:
        """A new pass at `position`: the sources restored, or read up to it (see `iterator_state`)."""
        if position.end:  # Nothing is left to read: no source is started.
            self._passes_started += 1
            self._next_pass_index = position.pass_index + 1
            return _Pass(PrefetchIterator(iter(()), self._place_marked, 0), self._batches)
        readers = resume_sources(self._start_passes, position, caller=caller)
        return self._start_pass(readers, position)

    def _require_restorable(self, caller: str) -> None:
        if self._unrestorable:
            kinds = ", ".join(sorted({type(source).__name__ for source in self._unrestorable}))
            raise TypeError(
                f"{caller}: this dataset reads a one-shot iterator ({kinds}), which cannot start a "
                "new pass, so its position could never be restored. Distribute a re-iterable source "
                "(a list, or an object whose __iter__ starts a new pass, restored by skipping what "
                "was taken), or an iterator with get_state() and set_state() (as Grain's have)."
            )

    def __len__(self) -> int:
        if self._cardinality < 0:
            raise TypeError(
                "This distributed dataset has no len(): how many batches it yields is not known "
                f"before reading them (cardinality {self._cardinality}), because its source has no "
                "len() or because InputOptions(partial_batch='drop') drops batches the replicas do "
                "not divide. Count them, or use `cardinality`."
            )
        return self._cardinality

    @property
    def cardinality(self) -> int:
        """The number of batches, or -1 (infinite) or -2 (unknown), as in `tf.data`."""
        return self._cardinality

    @property
    def element_spec(self) -> PyTree:
        """The first batch's structure: a pytree of `jax.ShapeDtypeStruct` with the sharding.

        Reading it before iterating reads one batch early; that pass is then the next `iter()`.

        Raises:
          ValueError: the dataset is empty.
        """
        if self._batches.element_spec is None:
            iterator = iter(self)
            try:
                spec = iterator.element_spec
            except BaseException:
                iterator.close()  # A failed peek must not leave a dead pass for the next iter().
                raise
            self._next_pass = iterator
            return spec
        return self._batches.element_spec


# A placed batch (or a dropped one) and its sources' positions once it is taken.
_Marked = tuple[_Batch | DroppedBatch, tuple[SourceMark, ...]]


def _marked(
    batches: Iterator[HostBatch | DroppedBatch], readers: list[SourceReader]
) -> Iterator[tuple[HostBatch | DroppedBatch, tuple[SourceMark, ...]]]:
    """Each of `batches` with the readers' positions right after it was made. The batchers read no
    element ahead of the batch they yield, so those are the elements it used and all before."""
    for batch in batches:
        yield batch, tuple(reader.mark for reader in readers)


@dataclasses.dataclass(frozen=True)
class _Pass:
    """One pass's prefetching, and the dataset's record of its batches' shapes."""

    prefetch: PrefetchIterator[_Marked]
    batches: _BatchTracker


class _BatchTracker:
    """What the passes over one dataset learn from its batches: the element spec, and whether
    shapes change mid-stream (worth one warning per dataset)."""

    def __init__(self, sharding: jax.sharding.Sharding | None):
        self._sharding = sharding
        self.element_spec: PyTree | None = None
        self._first: _Signature | None = None
        self._warned = False

    def record(self, batch: _Batch) -> None:
        if self.element_spec is None:
            self._first = batch.signature
            self.element_spec = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x), sharding=self._sharding),
                batch.value,
            )

    def differs(self, batch: _Batch, *, previous_differed: bool) -> bool:
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


class _NextInsideRunError(StrategyContextError, ValueError):
    """`next(iterator)` inside `run`: a ValueError, as TensorFlow raises, and a context error."""


class DistributedIterator:
    """One pass over a `DistributedDataset`, prefetching in a background thread.

    Iterate it, or call `get_next()` (which raises `OutOfRangeError` at the end, where `next()`
    raises StopIteration) or `get_next_as_optional()`. `close()` (or leaving a `with` block, or
    dropping the iterator) stops the thread. Threads may share an iterator: each batch goes to
    one of them, and the end to all of them.

    `get_state()` and `set_state(state)` save and restore its position, and a checkpoint saves
    and restores it where it sits in the tree: `checkpoint.save(directory, {'params': params,
    'data': iterator})`.

    Example:
      >>> import numpy as np, jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy()
      >>> dataset = strategy.experimental_distribute_dataset([np.zeros(2), np.ones(2)])
      >>> with iter(dataset) as iterator:
      ...     first = iterator.get_next()
      ...     rest = iterator.get_next_as_optional()
      ...     end = iterator.get_next_as_optional()
      >>> first.tolist(), rest.has_value(), rest.get_value().tolist(), end.has_value()
      ([0.0, 0.0], True, [1.0, 1.0], False)
    """

    def __init__(self, dataset: DistributedDataset, pass_: _Pass, position: PassPosition):
        self._dataset = dataset
        self._pass = pass_
        self._marks: tuple[SourceMark, ...] | None = None
        self._set_position(position)
        self._previous_differed = False
        self._closed = False
        # Threads sharing the iterator take batches one at a time, so that the shape checks see
        # them in the order they were delivered, and the position counts each once.
        self._lock = threading.Lock()

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> PyTree:
        if contexts.STATE.get().replica_context is not None:
            raise _NextInsideRunError(
                "next(iterator) should be called outside the function given to run(), e.g. "
                "strategy.run(step_fn, args=(next(iterator),))."
            )
        with self._lock:
            batch = self._next_batch()
            self._previous_differed = self._pass.batches.differs(
                batch, previous_differed=self._previous_differed
            )
        return batch.value

    def _take(self) -> _Batch | DroppedBatch:
        """The next item of the pass; the position moves past it."""
        try:
            item, self._marks = next(self._pass.prefetch)
        except StopIteration:
            if not self._closed:  # The end of the pass, not of this iterator.
                self._ended = True
            raise
        if not isinstance(item, DroppedBatch):
            self._taken += 1
        return item

    def _set_position(self, position: PassPosition) -> None:
        # Kept as the last batch's marks and a count, cheap to update; see `_position`.
        self._start = position
        self._marks = None
        self._taken = 0
        self._ended = position.end

    def _position(self) -> PassPosition:
        position = self._start.after(self._marks, taken=self._taken) if self._marks else self._start
        return dataclasses.replace(position, end=self._ended)

    def _next_batch(self) -> _Batch:
        """The next placed batch, after warning (here, in the user's thread) about dropped ones."""
        while isinstance(item := self._take(), DroppedBatch):
            warnings.warn(item.message, stacklevel=caller_stacklevel())
        return item

    def _peek_batch(self) -> _Batch:
        while isinstance(item := self._pass.prefetch.peek()[0], DroppedBatch):
            self._take()
            warnings.warn(item.message, stacklevel=caller_stacklevel())
        return item

    def get_next(self) -> PyTree:
        """Return the next batch; raise `OutOfRangeError` after the last one."""
        try:
            return next(self)
        except StopIteration:
            raise OutOfRangeError(
                "End of sequence: the distributed dataset has no more batches. Start a new pass "
                "with iter(dataset), or use get_next_as_optional()."
            ) from None

    def get_next_as_optional(self) -> OptionalBatch:
        """Return an `OptionalBatch`: the next batch, or none after the last one."""
        try:
            return OptionalBatch(next(self), has_value=True)
        except StopIteration:
            return OptionalBatch(None, has_value=False)

    def get_state(self) -> dict[str, Any]:
        """This pass's position, as a small JSON-serialisable dict, to restore with `set_state`.

        It counts what was taken (by `next`, `get_next`, ...), not what the background thread read
        ahead: `pass` (which pass of the dataset this is, from 0), `batches` (the batches taken),
        `elements` (per input pipeline, the source elements those batches used), `source_states`
        (per pipeline, the state of a source whose iterator has `get_state()`/`set_state()`, such
        as Grain's, else None) and `end` (the pass is over). In a job of several processes each
        process has its own position; checkpoints save each one.

        Raises:
          TypeError: the dataset reads a one-shot iterator (a generator object) without
            `get_state()`/`set_state()`, whose position could never be restored.

        Example:
          >>> import numpy as np, jaxstrategy
          >>> dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(
          ...     [np.full(2, i) for i in range(5)])
          >>> iterator = iter(dataset)
          >>> _ = next(iterator), next(iterator)
          >>> state = iterator.get_state()
          >>> state['pass'], state['batches'], state['elements']
          (0, 2, [2])
          >>> restored = iter(dataset)
          >>> restored.set_state(state)
          >>> next(restored).tolist()
          [2, 2]
        """
        self._dataset._require_restorable("DistributedIterator.get_state()")
        with self._lock:
            return self._position().as_state()

    def set_state(self, state: dict[str, Any]) -> None:
        """Move this iterator to the position `state` (from `get_state`) describes.

        The pass restarts there: batches prefetched so far are dropped, and the next batch is the
        one after the last taken when `state` was saved. A source whose iterator has
        `get_state()`/`set_state()` (such as Grain's) gets its saved state; any other source
        starts a new pass and its elements up to the position are read and dropped, here, before
        this returns (with a warning when that takes longer than 10 s). Every process of a job
        must call it, as every process iterates.

        Raises:
          TypeError: `state` is not such a dict, or the dataset reads a one-shot iterator without
            `get_state()`/`set_state()`.
          ValueError: `state` is malformed or of another dataset: another number of input
            pipelines, a source that ends before the saved position, or a saved source state where
            the source now has none.
        """
        caller = "DistributedIterator.set_state()"
        self._dataset._require_restorable(caller)
        position = PassPosition.from_state(state, num_sources=len(self._dataset._start_passes), caller=caller)
        with self._lock:
            old = self._pass.prefetch
            old.close()
            if self._dataset._one_shot and old.thread is not None:
                # The new pass reads the same iterator: the old thread must be done with it.
                old.thread.join(_ONE_SHOT_JOIN_S)
                if old.thread.is_alive():
                    raise RuntimeError(
                        f"{caller}: the input thread of this pass is still reading the dataset's "
                        f"one-shot iterator after {_ONE_SHOT_JOIN_S:.0f} s, so the iterator cannot be "
                        "set to another state: its next() does not return."
                    )
            self._pass = self._dataset._resume_pass(position, caller=caller)
            self._set_position(position)
            self._previous_differed = False
            self._closed = False

    @property
    def element_spec(self) -> PyTree:
        """The dataset's batch structure: a pytree of `jax.ShapeDtypeStruct` with the sharding.

        Raises:
          ValueError: the dataset is empty.
        """
        if self._pass.batches.element_spec is None:
            try:
                with self._lock:
                    self._pass.batches.record(self._peek_batch())
            except StopIteration:
                raise ValueError(
                    "This distributed dataset is empty (or InputOptions(partial_batch='drop') dropped "
                    "every batch), so it has no element_spec."
                ) from None
        return self._pass.batches.element_spec

    def close(self) -> None:
        """Stop the background thread and drop the batches it prefetched.

        `get_state()` still gives the position of the last batch taken.
        """
        self._closed = True
        self._pass.prefetch.close()

    def __enter__(self) -> DistributedIterator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _describe(signature: _Signature | None) -> str:
    if signature is None:
        return "none"
    return ", ".join(f"{dtype.name}{list(shape)}" for shape, dtype in signature.shapes_and_dtypes)


class OptionalBatch:
    """What `get_next_as_optional()` returns: a batch, or nothing after the last one.

    Example:
      >>> import numpy as np, jaxstrategy
      >>> iterator = iter(jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset([np.ones(1)]))
      >>> [iterator.get_next_as_optional().has_value() for _ in range(2)]
      [True, False]
    """

    def __init__(self, value: PyTree, *, has_value: bool):
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """Whether there is a batch."""
        return self._has_value

    def get_value(self) -> PyTree:
        """Return the batch; raise ValueError when there is none."""
        if not self._has_value:
            raise ValueError(
                "get_value(): this optional has no value (the iterator reached the end); "
                "check has_value() first."
            )
        return self._value
