"""Ending an input pass at the same step on every process of a multi-process job.

Each process reads its own input. If one process's input ends while the others still have
batches, the others would go on to a step the first never runs and wait forever in its
collectives. So before each step's batch is handed out, the processes agree on how many of them
have one, and a pass ends for all at the first step where not every process has one. They also
check that their batches fit together: parts of different shapes (a short last batch on one
process) would make a global array of memory nobody wrote, so that is an error on every process.

They agree through JAX's coordination service: the key-value store that every process of a
`jax.distributed` job reaches through its coordinator. No device takes part, so agreeing runs in
the input thread, ahead of the training steps, and never queues behind them. Each step costs one
write and one atomic increment per process, one blocking read for all but the last to arrive,
and one read of every signature for the last:

- a process with a batch writes its signature (structure, shapes, dtypes) under the step;
- it adds `1 + has_batch * (num_processes + 1)` to the step's counter, so the sum
  carries both how many processes have arrived and how many of them have a batch;
- the last to arrive publishes how many have a batch, or, when all have one but the signatures
  differ, what each process has; and it deletes the previous step's keys
  (every process has read them: each read them before arriving here);
- the others wait for that result, a second at a time so that closing the iterator ends the
  wait, and give up with an error after `timeout_s`;
- at the step that ends the pass, each process counts itself out once it has the result, and
  the last one deletes the step's keys.

A process that dies is not waited for here: JAX's heartbeat ends every other process. The
timeout catches processes that, all alive, wait on different keys: datasets created or iterated
in different orders.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

import jax

from jaxstrategy._src.cluster.coordination import value_when_set
from jaxstrategy._src.core.jax_compat import coordination_client
from jaxstrategy._src.input.replica_batches import DroppedBatch, HostBatch

T = TypeVar("T")

_POLL_MS = 1000
_dataset_serials = itertools.count()


def new_dataset_namespace() -> str:
    """A key prefix for one distributed dataset: the same on every process, because every process
    creates the same datasets in the same order."""
    return f"jaxstrategy/input/{next(_dataset_serials)}"


class StepAgreement:
    """How many processes have a batch at each step of one pass; see the module docstring.

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
        self._client = coordination_client() if client is None else client
        self._num_processes = jax.process_count() if num_processes is None else num_processes
        self._process_id = jax.process_index() if process_id is None else process_id
        self._namespace = namespace
        self._stop = stop
        self._caller = caller
        self._timeout_s = timeout_s

    @property
    def num_processes(self) -> int:
        return self._num_processes

    def count(self, step: int, signature: str | None) -> int | None:
        """How many processes have a batch at `step`; None when the consumer went away meanwhile.

        Args:
          step: the step, counted from 0 in the pass.
          signature: this process's batch's structure, shapes and dtypes; None when it has none.

        Raises:
          ValueError: every process has a batch, but their signatures differ (one program cannot
            take them: the global arrays would be assembled from parts that do not fit).
          TimeoutError: the other processes did not reach `step` within the timeout.
        """
        n = self._num_processes
        key = f"{self._namespace}/{step}"
        has_batch = signature is not None
        if has_batch:
            self._client.key_value_set(f"{key}/signature/{self._process_id}", signature)
        total = self._client.key_value_increment(f"{key}/count", 1 + int(has_batch) * (n + 1))
        arrived, with_batch = total % (n + 1), total // (n + 1)
        result: str | None
        if arrived == n:
            result = str(with_batch)
            if with_batch == n:
                signatures = dict(self._client.key_value_dir_get(f"{key}/signature/"))
                if len(set(signatures.values())) > 1:
                    result = _mismatch(signatures)
            self._client.key_value_set(f"{key}/result", result)
            if step:
                self._delete(step - 1)
        else:
            result = self._wait_for_result(key, step)
        if result is None:
            return None
        if not result.isdigit():
            # Every process raises; the pass's keys stay, as a pass ended by an error may.
            raise ValueError(f"{self._caller}: at step {step} of this pass, {result}")
        with_batch = int(result)
        if with_batch < n:  # The pass ends here: the last one out cleans up.
            if self._client.key_value_increment(f"{key}/done", 1) == n:
                self._delete(step)
        return with_batch

    def _delete(self, step: int) -> None:
        self._client.key_value_delete(f"{self._namespace}/{step}")  # With every key under it.

    def _wait_for_result(self, key: str, step: int) -> str | None:
        deadline = time.monotonic() + self._timeout_s
        while not self._stop.is_set():
            result = value_when_set(self._client, f"{key}/result", _POLL_MS)
            if result is not None:
                return result
            if time.monotonic() > deadline:
                arrived = int(self._client.key_value_try_get(f"{key}/count")) % (self._num_processes + 1)
                raise TimeoutError(
                    f"{self._caller}: process {self._process_id} waited {self._timeout_s:.0f} s for "
                    f"the other processes to reach step {step} of this dataset's pass, and only "
                    f"{arrived} of {self._num_processes} did. Every process must create and iterate "
                    "the same distributed datasets in the same order (the same passes, and the same "
                    "element_spec reads)."
                )
        return None


def batch_signature(batch: Any) -> str:
    """What must match across processes for their parts of a batch to make one global batch."""
    if not isinstance(batch, HostBatch):
        return ""
    leaves = ", ".join(f"{leaf.dtype}{list(leaf.shape)}" for leaf in batch.leaves)
    mask = "" if batch.mask is None else f" with mask {list(batch.mask.shape)}"
    return f"{batch.treedef}: {leaves}{mask}"


def _mismatch(signatures: dict[str, str]) -> str:
    by_process = sorted((int(key.rpartition("/")[2]), signature) for key, signature in signatures.items())
    lines = "".join(f"\n  process {process}: {signature}" for process, signature in by_process)
    return (
        "the processes' batches differ in structure, shape or dtype, so they cannot make one "
        f"global batch (one program runs on every replica):{lines}\nGive every process batches "
        "of the same shapes: the same per-process batch size, with the remainder dropped "
        "(drop_remainder=True) or padded (InputOptions(partial_batch='pad'))."
    )


def agreed_steps(
    batches: Iterator[T], agreement: StepAgreement, *, cardinality: int, caller: str
) -> Iterator[T | DroppedBatch]:
    """The batches of `batches` up to the first step at which some process has none.

    `DroppedBatch` items pass through without a step of their own. When the processes' inputs
    end at different steps, a `DroppedBatch` carrying the warning comes last on every process.

    Args:
      batches: this process's batches for one pass.
      agreement: the pass's `StepAgreement`.
      cardinality: how many batches `batches` yields, or a negative number when unknown.
      caller: the call to name in the warning.
    """
    n = agreement.num_processes
    for step in itertools.count():
        item = next(batches, None)
        while isinstance(item, DroppedBatch):
            yield item
            item = next(batches, None)
        has_batch = item is not None
        with_batch = agreement.count(step, batch_signature(item) if has_batch else None)
        if with_batch is None:
            return  # The consumer went away.
        if with_batch == n:
            assert item is not None  # Every process has a batch, this one included.
            yield item
            continue
        if with_batch:
            if has_batch:
                left = f"{cardinality - step} batch(es)" if cardinality >= 0 else "at least one batch"
                here = f"this process leaves {left} unread"
            else:
                here = "this process's input is one of those that ended"
            yield DroppedBatch(
                f"{caller}: the input of {n - with_batch} of {n} processes ended at step {step} while "
                f"the others still had batches, so every process ends this pass there (going on would "
                f"wait forever in the step's collectives); {here}. Give every process the same "
                "number of batches, for example by sharding the data evenly and dropping the remainder."
            )
        return
