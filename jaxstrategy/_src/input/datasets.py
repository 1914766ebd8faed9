"""Distributed datasets: any host iterable of batches, prefetched onto a strategy's device(s).

`DistributedDataset` wraps its sources; each `iter()` starts a fresh pass, a `DistributedIterator`
whose `PrefetchIterator` reads them in a background thread and places each batch. Each batch
travels with its sources' positions after it, so that `get_state` counts what the user took.
docs/internals.md, "Input", shows how the input modules fit together.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from jaxstrategy._src.core.errors import JaxStrategyError, StrategyContextError, caller_stacklevel
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.input.agreement import StepAgreement, agreed_steps, new_dataset_namespace
from jaxstrategy._src.input.iterator_state import (
    PassPosition,
    SourceMark,
    SourceReader,
    fingerprint,
    is_stateful,
    resume_sources,
)
from jaxstrategy._src.input.placement import BatchPlacer, BatchTracker, PlacedBatch
from jaxstrategy._src.input.prefetch import PrefetchIterator
from jaxstrategy._src.input.replica_batches import (
    DroppedBatch,
    Grouping,
    HostBatch,
    HostElement,
    ReplicaBatcher,
    ReplicaLayout,
)
from jaxstrategy._src.input.sources import (
    cardinality_of,
    grouped_cardinality,
    host_elements,
    host_passes,
    is_in_memory,
)
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.contexts import InputContext
from jaxstrategy._src.values.options import InputOptions, InputReplicationMode

# How long `set_state` waits for the input thread to finish reading a one-shot iterator.
_ONE_SHOT_JOIN_S = 60.0


class OutOfRangeError(JaxStrategyError):
    """`DistributedIterator.get_next()` was called after the last element."""


_DOUBLE_BUFFER = 2


def _buffer_size(options: InputOptions, layout: ReplicaLayout, sources: list[Any]) -> int:
    """The batches to keep placed ahead: the option's, or when it is None, 2 unless a thread would
    only take cores from the step (CPU devices fed from memory; see `InputOptions`)."""
    if options.experimental_per_replica_buffer_size is not None:
        return options.experimental_per_replica_buffer_size
    on_cpu = all(device.platform == "cpu" for device in layout.sharding.device_set)  # type: ignore[attr-defined]
    # Across processes the thread also runs the processes' agreement (round trips to the
    # coordinator: at a pass's first and last steps, or at every step of a source without a
    # len()), which it keeps off the step's path.
    if on_cpu and not layout.is_multi_process and all(is_in_memory(s) for s in sources):
        return 0
    return _DOUBLE_BUFFER


def input_options(options: InputOptions | None, caller: str, *, per_replica_supported: bool) -> InputOptions:
    """`options` checked (`InputOptions()` when None); PER_REPLICA only where `per_replica_supported`.

    Raises:
      TypeError: `options` is not an `InputOptions`.
      NotImplementedError: `InputReplicationMode.PER_REPLICA` where it is not supported.
    """
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"{caller}: options must be a jaxstrategy.InputOptions; got {options!r}.")
    per_replica = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
    if per_replica and not per_replica_supported:
        raise NotImplementedError(
            f"{caller}: InputReplicationMode.PER_REPLICA is only supported in "
            "`distribute_datasets_from_function` of a strategy with several replicas "
            "(MirroredStrategy); use PER_WORKER (the default)."
        )
    return options


def distribute_dataset(
    dataset: Any, *, layout: ReplicaLayout, options: InputOptions, caller: str
) -> DistributedDataset:
    """What `Strategy.experimental_distribute_dataset` returns: each element of `dataset` a global
    batch, split over the replicas."""
    return DistributedDataset([dataset], layout=layout, grouping="split", options=options, caller=caller)


def distribute_datasets_from_function(
    dataset_fn: Callable[[InputContext], Any],
    *,
    layout: ReplicaLayout,
    input_pipeline: tuple[int, int],
    options: InputOptions,
    caller: str,
) -> DistributedDataset:
    """What `Strategy.distribute_datasets_from_function` returns: `dataset_fn` called once per
    input pipeline, its elements per-replica batches.

    With `InputReplicationMode.PER_REPLICA` each of this process's replicas is a pipeline and
    reads its own dataset (`zip`); otherwise the process has one pipeline, `input_pipeline`
    (`(num_input_pipelines, input_pipeline_id)`), whose consecutive elements go to consecutive
    replicas (`consecutive`), or whole to a single unstacked replica (`split`).
    """
    n = layout.num_replicas
    if options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
        input_contexts = [InputContext(n, i, n) for i in layout.local_replica_ids]
        grouping: Grouping = "zip"
    else:
        input_contexts = [InputContext(*input_pipeline, n)]
        grouping = "consecutive" if layout.stacked else "split"
    sources = [dataset_fn(context) for context in input_contexts]
    return DistributedDataset(sources, layout=layout, grouping=grouping, options=options, caller=caller)


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
        # Where this process holds only some replicas: with every replica (one split over the
        # processes), its host batches are whole.
        if len(layout.local_replica_ids) < layout.num_replicas and not on_device:
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
        self._cardinality = grouped_cardinality(
            [cardinality_of(source) for source in sources], fed, grouping, options.partial_batch
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
        self._keep_jax_arrays = not layout.stacked  # See `host_elements`.
        self._caller = caller
        # Where processes read their own inputs, they agree where a pass ends (input/agreement.py).
        self._agreement_namespace = new_dataset_namespace() if layout.is_multi_process else None
        self._input_timeout_s = layout.input_timeout_s
        # Every pass started, restored ones included: each gets its own agreement namespace.
        self._passes_started = 0
        # The number the next pass gets, which a restored pass moves on.
        self._next_pass_index = 0
        self._next_pass: DistributedIterator | None = None
        self._batches = BatchTracker(layout.sharding if on_device else None)

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
        # Each element's fingerprint is taken here too, from its private host copy before it is
        # placed: only the number is kept (see `iterator_state`).
        batches: Iterator[HostBatch | DroppedBatch] = self._batcher.batches(
            [
                reader.fingerprinted(host_elements(reader, keep_jax_arrays=self._keep_jax_arrays), _leaves)
                for reader in readers
            ]
        )
        stopped = threading.Event()
        if self._agreement_namespace is not None:
            namespace = f"{self._agreement_namespace}/{self._passes_started}"
            agreement = StepAgreement(
                namespace, stop=stopped, caller=self._caller, timeout_s=self._input_timeout_s
            )
            # A restored pass has the batches after its position left.
            left = self._cardinality - position.batches if self._cardinality >= 0 else self._cardinality
            batches = agreed_steps(batches, agreement, cardinality=left, caller=self._caller)
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
        if position.end:
            # Nothing is left to read; but a source restored by skipping is read to its last
            # element again, to check it is the pass that was saved (a save after each epoch
            # saves one that ended), since the next pass follows from it.
            if any(saved is not None for saved in position.fingerprints):
                resume_sources(
                    self._start_passes, position, fingerprint_of=self._fingerprint_of, caller=caller
                )
            self._passes_started += 1
            self._next_pass_index = position.pass_index + 1
            return _Pass(PrefetchIterator(iter(()), self._place_marked, 0), self._batches)
        readers = resume_sources(
            self._start_passes, position, fingerprint_of=self._fingerprint_of, caller=caller
        )
        return self._start_pass(readers, position)

    def _fingerprint_of(self, element: Any) -> int:
        """The fingerprint of a source's element, of its host copy as a pass takes it."""
        return fingerprint(next(host_elements(iter([element]), keep_jax_arrays=self._keep_jax_arrays)).leaves)

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


def _leaves(element: HostElement) -> list[Any]:
    return element.leaves


# A placed batch (or a dropped one) and its sources' positions once it is taken.
_Marked = tuple[PlacedBatch | DroppedBatch, tuple[SourceMark, ...]]


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
    batches: BatchTracker


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

    def _take(self) -> PlacedBatch | DroppedBatch:
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

    def _next_batch(self) -> PlacedBatch:
        """The next placed batch, after warning (here, in the user's thread) about dropped ones."""
        while isinstance(item := self._take(), DroppedBatch):
            warnings.warn(item.message, stacklevel=caller_stacklevel())
        item.require_not_donated()
        return item

    def _peek_batch(self) -> PlacedBatch:
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
        as Grain's, else None), `end` (the pass is over) and `fingerprints` (per pipeline, a CRC32C
        of the last element taken from a source restored by skipping, else None). In a job of
        several processes each process has its own position; checkpoints save each one.

        Raises:
          TypeError: the dataset reads a one-shot iterator (a generator object) without
            `get_state()`/`set_state()`, whose position could never be restored; a source's
            `get_state()` returned a state that is neither bytes nor JSON (the message names the
            source and the part JSON cannot hold).

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
        caller = "DistributedIterator.get_state()"
        self._dataset._require_restorable(caller)
        with self._lock:
            return self._position().as_state(caller=caller)

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
            the source now has none; or a source restored by skipping yields another element at
            the position than it did when the state was saved (a shuffle seeded by a counter that
            restarts at 0, not by the pass number). A pass that ended is read again for that check.
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


class OptionalBatch:
    """What `get_next_as_optional()` returns: a batch, or nothing after the last one.

    Example:
      >>> import numpy as np, jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy()
      >>> iterator = iter(strategy.experimental_distribute_dataset([np.ones(1)]))
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
                "OptionalBatch.get_value(): this optional has no value (the iterator reached the end); "
                "check has_value() first."
            )
        return self._value
