"""Ending an input pass at the same step on every process of a multi-process job.

Each process reads its own input. A process whose input ended would leave the others waiting
forever in the next step's collectives, and batches of different shapes cannot make one global
array. So the processes agree, through JAX's coordination service and in the input thread, on
each pass's number of steps and on their batches' shapes: twice a pass where every source has a
`len()`, at every step otherwise. docs/internals.md, "Input", describes the rounds.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any, TypeVar

import jax

from jaxstrategy._src.cluster.coordination import KeyValueStore, new_namespace
from jaxstrategy._src.input.replica_batches import DroppedBatch, HostBatch

T = TypeVar("T")

_POLL_MS = 1000
# Between a step's signature and the number of batches its process's source says it has.
_LENGTH_SEPARATOR = "\x1f"


def new_dataset_namespace() -> str:
    """A key prefix for one distributed dataset: the same on every process, because every process
    creates the same datasets in the same order."""
    return new_namespace("input")


class StepAgreement:
    """The processes' agreements over one pass (docs/internals.md, "Input", describes them).

    Args:
      namespace: the pass's key prefix, the same on every process.
      stop: set when the consumer is gone; ends a wait early.
      caller: the call to name in messages.
      timeout_s: how long to wait for the other processes at one step.
      client: the coordination service's client (JAX's when None).
      num_processes: how many processes agree (JAX's process count when None).
      process_id: this process's index among them (JAX's when None).
    """

    def __init__(
        self,
        namespace: str,
        *,
        stop: threading.Event,
        caller: str,
        timeout_s: float,
        client: Any = None,
        num_processes: int | None = None,
        process_id: int | None = None,
    ):
        self._store = KeyValueStore(client)
        self._num_processes = jax.process_count() if num_processes is None else num_processes
        self._process_id = jax.process_index() if process_id is None else process_id
        self._namespace = namespace
        self._stop = stop
        self._caller = caller
        self._timeout_s = timeout_s
        # Every process's number of batches, once the first step agreed that every one has one.
        self.lengths: list[int] | None = None

    @property
    def num_processes(self) -> int:
        return self._num_processes

    @property
    def process_id(self) -> int:
        return self._process_id

    def count(self, step: int, signature: str | None, length: int = -1) -> int | None:
        """How many processes have a batch at `step`; None when the consumer went away meanwhile.

        At step 0, `length` is this process's number of batches (negative when unknown); when
        every process has a batch and a length, `lengths` holds them all afterwards.

        Args:
          step: the step, counted from 0 in the pass.
          signature: this process's batch's structure, shapes and dtypes; None when it has none.
          length: at step 0, how many batches this process's source says it has.

        Raises:
          ValueError: every process has a batch, but their signatures differ (one program cannot
            take them: the global arrays would be assembled from parts that do not fit).
          TimeoutError: the other processes did not reach `step` within the timeout.
        """
        n = self._num_processes
        key = f"{self._namespace}/{step}"
        has_batch = signature is not None
        if has_batch:
            posted = f"{signature}{_LENGTH_SEPARATOR}{length}" if step == 0 else str(signature)
            self._store.set(f"{key}/signature/{self._process_id}", posted)
        total = self._store.increment(f"{key}/count", 1 + int(has_batch) * (n + 1))
        arrived, with_batch = total % (n + 1), total // (n + 1)
        result: str | None
        if arrived == n:
            result = str(with_batch)
            if with_batch == n:
                result = _step_result(self._store.values_under(f"{key}/signature/"), n)
            self._store.set(f"{key}/result", result)
            if step:
                self._delete(step - 1)
        else:
            result = self._wait_for(f"{key}/result", step, arrived=lambda count: count % (n + 1))
        if result is None:
            return None
        if not result[0].isdigit():
            # Every process raises; the pass's keys stay, as a pass ended by an error may.
            raise ValueError(f"{self._caller}: at step {step} of this pass, {result}")
        with_batch_text, _, lengths = result.partition(" ")
        with_batch = int(with_batch_text)
        if lengths:
            self.lengths = [int(length) for length in lengths.split(",")]
        if with_batch < n:  # The pass ends here: the last one out cleans up.
            self.finish(step)
        return with_batch

    def last_step(self, step: int, signature: str | None, has_more: bool) -> bool:
        """Agree at the last step of a pass of known length; whether to hand out its batch.

        Args:
          step: the pass's last step (one less than its agreed number of steps).
          signature: this process's batch there; None when its source ran out before it.
          has_more: whether its source yields a batch after this one.

        Returns:
          True, unless the consumer went away meanwhile.

        Raises:
          ValueError: the processes' last batches differ, a source yields more or fewer batches
            than its `len()` says, or another process posted an error during the pass.
          TimeoutError: the other processes did not reach this step within the timeout.
        """
        n = self._num_processes
        key = f"{self._namespace}/last"
        mine = json.dumps({"signature": signature, "more": has_more})
        self._store.set(f"{key}/post/{self._process_id}", mine)
        if self._store.increment(f"{key}/count", 1) == n:
            posts = self._store.values_under(f"{key}/post/")
            result = _last_step_result(posts, self.lengths or [], step)
            self._store.set(f"{key}/result", result)
        else:
            found = self._wait_for(f"{key}/result", step, arrived=lambda count: count, watch_errors=True)
            if found is None:
                return False
            result = found
        self.finish(step)
        if result:
            raise ValueError(f"{self._caller}: at step {step} of this pass, {result}")
        return True

    def post_error(self, message: str) -> None:
        """Tell the other processes of an error that ends this pass here (they raise it at the
        pass's last step); the first error posted wins."""
        self._store.set_once(f"{self._namespace}/error", message)

    def finish(self, step: int) -> None:
        """Count this process out of the pass; the last one out deletes its keys."""
        if self._store.increment(f"{self._namespace}/done/{step}", 1) == self._num_processes:
            self._store.delete(self._namespace)  # With every key under it.

    def _delete(self, step: int) -> None:
        self._store.delete(f"{self._namespace}/{step}")  # With every key under it.

    def _raise_posted_error(self) -> None:
        posted = self._store.get_now(f"{self._namespace}/error")
        if posted is not None:
            raise ValueError(posted)

    def _wait_for(
        self, result_key: str, step: int, *, arrived: Callable[[int], int], watch_errors: bool = False
    ) -> str | None:
        """The result under `result_key` (the sibling of the round's `count`) once the last to
        arrive publishes it; None when the consumer goes away first. `arrived` reads how many
        processes arrived from the count. With `watch_errors`, an error another process posted
        (`post_error`) ends the wait: it is raised here."""
        deadline = time.monotonic() + self._timeout_s
        result = self._store.wait_for(
            result_key,
            deadline=deadline,
            stop=self._stop,
            poll_ms=_POLL_MS,
            interrupt=self._raise_posted_error if watch_errors else None,
        )
        if result is None and not self._stop.is_set():
            count_key = f"{result_key.rpartition('/')[0]}/count"
            how_many = arrived(int(self._store.get_now(count_key) or 0))
            raise TimeoutError(
                f"{self._caller}: process {self._process_id} waited {self._timeout_s:.0f} s for "
                f"the other processes to reach step {step} of this dataset's pass, and only "
                f"{how_many} of {self._num_processes} did. Every process must create and iterate "
                "the same distributed datasets in the same order (the same passes, and the same "
                "element_spec reads)."
            )
        return result


def batch_signature(batch: Any) -> str:
    """What must match across processes for their parts of a batch to make one global batch."""
    if not isinstance(batch, HostBatch):
        return ""
    leaves = ", ".join(f"{leaf.dtype}{list(leaf.shape)}" for leaf in batch.leaves)
    mask = "" if batch.mask is None else f" with mask {list(batch.mask.shape)}"
    return f"{batch.treedef}: {leaves}{mask}"


def _step_result(posts: dict[str, str], n: int) -> str:
    """What the last to arrive publishes at a step where every process has a batch: the number,
    with every process's number of batches when all know theirs (at step 0), or the mismatch."""
    signatures, lengths = {}, {}
    for key, posted in posts.items():
        process = int(key.rpartition("/")[2])
        signature, _, length = posted.partition(_LENGTH_SEPARATOR)
        signatures[process] = signature
        lengths[process] = int(length) if length else -1
    if len(set(signatures.values())) > 1:
        return _mismatch(signatures)
    if len(lengths) == n and all(length >= 0 for length in lengths.values()):
        return f"{n} " + ",".join(str(lengths[p]) for p in range(n))
    return str(n)


def _mismatch(signatures: dict[int, str]) -> str:
    lines = "".join(
        f"\n  process {process}: {signature}" for process, signature in sorted(signatures.items())
    )
    return (
        "the processes' batches differ in structure, shape or dtype, so they cannot make one "
        f"global batch (one program runs on every replica):{lines}\nGive every process batches "
        "of the same shapes: the same per-process batch size, with the remainder dropped "
        "(drop_remainder=True) or padded (InputOptions(partial_batch='pad'))."
    )


def _last_step_result(posts: dict[str, str], lengths: list[int], step: int) -> str:
    """What the last to arrive at a pass's last step publishes: '' to go on, else the error."""
    by_process = {int(key.rpartition("/")[2]): json.loads(value) for key, value in posts.items()}
    steps = step + 1
    wrong_lengths = []
    for process, post in sorted(by_process.items()):
        said = lengths[process] if process < len(lengths) else steps
        if post["signature"] is None:
            wrong_lengths.append(_wrong_length(process, said, f"only {step}"))
        elif said == steps and post["more"]:
            wrong_lengths.append(_wrong_length(process, said, f"more than {said}"))
        elif said > steps and not post["more"]:
            wrong_lengths.append(_wrong_length(process, said, f"only {steps}"))
    if wrong_lengths:
        return "\n".join(wrong_lengths)
    signatures = {process: post["signature"] for process, post in by_process.items()}
    return _mismatch(signatures) if len(set(signatures.values())) > 1 else ""


def _wrong_length(process: int, said: int, yielded: str) -> str:
    """The error for a process whose source's `len()` said `said` batches but yielded `yielded`."""
    return (
        f"the input of process {process} says it has {said} batch(es) (its source's len()), but it "
        f"yields {yielded}. The processes agree on a pass's steps from those lengths, so a length "
        "that is wrong would leave processes waiting for each other. Make the source's __len__ "
        "return the number of elements its __iter__ yields, or give it no __len__."
    )


def agreed_steps(
    batches: Iterator[T], agreement: StepAgreement, *, cardinality: int, caller: str
) -> Iterator[T | DroppedBatch]:
    """The batches of `batches` up to the first step at which some process has none.

    `DroppedBatch` items pass through without a step of their own. When the processes' inputs
    end at different steps, a `DroppedBatch` carrying the warning comes last on every process.
    When every process knows its number of batches, only the pass's first and last steps are
    agreed on (docs/internals.md, "Input", describes both ways).

    Args:
      batches: this process's batches for one pass.
      agreement: the pass's `StepAgreement`.
      cardinality: how many batches `batches` yields, or a negative number when unknown.
      caller: the call to name in messages.

    Raises:
      ValueError: the processes' batches do not fit together, or a source's `len()` is wrong.
      TimeoutError: the other processes did not reach a step within the agreement's timeout.
    """
    n = agreement.num_processes
    for step in itertools.count():
        item = yield from _next_batch(batches)
        has_batch = item is not None
        signature = batch_signature(item) if has_batch else None
        with_batch = agreement.count(step, signature, cardinality if step == 0 else -1)
        if with_batch is None:
            return  # The consumer went away.
        if with_batch == n:
            assert item is not None  # Every process has a batch, this one included.
            if agreement.lengths is not None:
                yield from _agreed_pass(item, batches, agreement, caller=caller)
                return
            yield item
            continue
        if with_batch:
            yield _ended_elsewhere(step, n, with_batch, has_batch, cardinality - step, caller)
        return


def _agreed_pass(
    first: T, batches: Iterator[T], agreement: StepAgreement, *, caller: str
) -> Iterator[T | DroppedBatch]:
    """A pass whose every process knows its number of batches, from its first batch on, which
    every process has and whose signature they agreed on at step 0."""
    lengths = agreement.lengths
    assert lengths is not None
    n, me, steps = len(lengths), agreement.process_id, min(lengths)
    if steps < 1:  # Every process had a first batch, so a source that says it has none lied.
        raise ValueError(
            f"{caller}: at step 0 of this pass, {_wrong_length(lengths.index(steps), steps, 'some')}"
        )
    signature = batch_signature(first)
    item: T | None = first
    for step in range(1, steps):
        yield item  # type: ignore[misc]  # Agreed at step 0, or checked below.
        item = yield from _next_batch(batches)
        if step == steps - 1:
            break  # The last step: agreed on below.
        problem = None
        if item is None:
            problem = _wrong_length(me, lengths[me], f"only {step}")
        elif (found := batch_signature(item)) != signature:
            problem = _unlike_first(me, found, signature)
        if problem is not None:
            message = f"{caller}: at step {step} of this pass, {problem}"
            agreement.post_error(message)
            raise ValueError(message)
    has_more = (yield from _next_batch(batches)) is not None
    if not agreement.last_step(steps - 1, None if item is None else batch_signature(item), has_more):
        return  # The consumer went away.
    yield item  # type: ignore[misc]  # Agreed on at the last step.
    with_batch = sum(length > steps for length in lengths)
    if with_batch:
        yield _ended_elsewhere(steps, n, with_batch, lengths[me] > steps, lengths[me] - steps, caller)


def _next_batch(batches: Iterator[T]) -> Generator[DroppedBatch, None, T | None]:
    """Pass on the `DroppedBatch` items up to the next batch, and return that batch (None at
    the end): `item = yield from _next_batch(batches)`."""
    item = next(batches, None)
    while isinstance(item, DroppedBatch):
        yield item
        item = next(batches, None)
    return item


def _unlike_first(process: int, found: str, first: str) -> str:
    return (
        f"process {process}'s batch is {found}, but the pass's first batch, alike on every process, "
        f"was {first}. With a len(), every batch of a pass but the last must have the first's "
        "structure, shape and dtype, since the processes check them without asking each other. "
        "Give every process batches of the same shapes (the remainder dropped with "
        "drop_remainder=True, or padded with InputOptions(partial_batch='pad')), or, for batches "
        "whose shapes change within a pass, a source without a len(), whose batches the processes "
        "compare step by step."
    )


def _ended_elsewhere(
    step: int, n: int, with_batch: int, has_batch: bool, left: int, caller: str
) -> DroppedBatch:
    """The warning where the inputs of `n - with_batch` processes ended at `step` while the
    others' went on; `left` is how many batches this process leaves unread (negative: unknown)."""
    if has_batch:
        unread = f"{left} batch(es)" if left >= 0 else "at least one batch"
        here = f"this process leaves {unread} unread"
    else:
        here = "this process's input is one of those that ended"
    return DroppedBatch(
        f"{caller}: the input of {n - with_batch} of {n} processes ended at step {step} while "
        f"the others still had batches, so every process ends this pass there (going on would "
        f"wait forever in the step's collectives); {here}. Give every process the same "
        "number of batches, for example by sharding the data evenly and dropping the remainder."
    )
