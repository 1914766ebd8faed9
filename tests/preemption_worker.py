"""A training job for tests/checkpoint/test_preemption.py: SGD with momentum on fixed data, for a few epochs,
under a `PreemptionHandler`, stopped by SIGTERM at a chosen step and resumed by running it again.

Run as a program it is one process of a job (`--strategy multi-worker`, started by
`run_local_workers`) or a job of its own; it prints one line per step, `loss <step> <hex>`, the
loss exactly (`float.hex`). The tests also import `train` and run it in their own process.

Input: with one process, `experimental_distribute_dataset` of a list of global batches (restored
by skipping what was taken) or, with `--stateful`, `distribute_datasets_from_function` of a source
whose iterator has get_state/set_state (restored from its state); with several processes, each
process reads its own pipeline: process 0 a list, the others the stateful source, so their saved
positions differ in kind. With `--source grain` (one process), a Grain pipeline of the same
examples, shuffled anew each epoch and batched, all the epochs in one pass read by Grain's threads
(restored from Grain's own state).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax  # Importing starts nothing: MultiWorkerMirroredStrategy() must still come first.
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import PartitionSpec

import jaxstrategy
from jaxstrategy import checkpoint

NUM_FEATURES = 8
EXAMPLES_PER_ELEMENT = 4
ELEMENTS_PER_PIPELINE = 12


OPTIMIZER = optax.sgd(0.01, momentum=0.9)


def init_params(key: jax.Array) -> Any:
    return {"w": 0.1 * jax.random.normal(key, (NUM_FEATURES, 1)), "b": jnp.zeros(1)}


def train_step(params: Any, opt_state: Any, batch: Any) -> Any:
    x, y = batch

    def loss_fn(p: Any) -> jax.Array:
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    loss, grads = jaxstrategy.get_replica_context().all_reduce("mean", (loss, grads))
    updates, opt_state = OPTIMIZER.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss


def _elements(pipeline: int, count: int) -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(100 + pipeline)
    return [
        (
            rng.standard_normal((EXAMPLES_PER_ELEMENT, NUM_FEATURES)).astype(np.float32),
            rng.standard_normal((EXAMPLES_PER_ELEMENT, 1)).astype(np.float32),
        )
        for _ in range(count)
    ]


def _rows_held(leaf: jax.Array) -> int:
    """How many of a `(NUM_FEATURES, 1)` leaf's rows this process's devices hold."""
    rows = range(NUM_FEATURES)
    return len({row for shard in leaf.addressable_shards for row in rows[shard.index[0]]})


def _grain_epochs(examples: list[tuple[Any, Any]], batch_size: int, epochs: int) -> Any:
    """A Grain pipeline of `examples`, each epoch in its own order, in batches: one pass."""
    import grain  # Only here: the test extra has it, the library does not need it.

    return (
        grain.MapDataset.source(examples)
        .shuffle(seed=5)
        .repeat(epochs)
        .batch(batch_size)
        .to_iter_dataset(grain.ReadOptions(num_threads=2, prefetch_buffer_size=4))
    )


class Shuffled:
    """Global batches, each pass in the order of `epoch`: set by the loop from the pass the
    restored iterator is in (`counter=False`, the right habit), or bumped by each `__iter__`
    (`counter=True`: it restarts at 0 in a new process, which the restore's check catches)."""

    def __init__(self, batches: list[Any], *, counter: bool):
        self.batches, self.counter, self.epoch = batches, counter, 0

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Any]:
        order = np.random.default_rng(self.epoch).permutation(len(self.batches))
        if self.counter:
            self.epoch += 1
        return (self.batches[i] for i in order)


class EpochShuffled:
    """A source whose passes are epochs, each in its own seeded order; its iterator has Grain's
    get_state/set_state protocol, so a pass is restored from its state, epoch included."""

    def __init__(self, elements: list[Any]):
        self.elements = elements
        self.next_epoch = 0

    def __iter__(self) -> EpochIterator:
        iterator = EpochIterator(self, self.next_epoch)
        self.next_epoch += 1
        return iterator


class EpochIterator:
    def __init__(self, source: EpochShuffled, epoch: int):
        self._source = source
        self._set(epoch, 0)

    def _set(self, epoch: int, index: int) -> None:
        self.epoch, self.index = epoch, index
        self._order = np.random.default_rng(epoch).permutation(len(self._source.elements))

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> Any:
        if self.index == len(self._order):
            raise StopIteration
        self.index += 1
        return self._source.elements[self._order[self.index - 1]]

    def get_state(self) -> bytes:
        return f"{self.epoch} {self.index}".encode()  # Bytes, as Grain's DataLoaderIterator gives.

    def set_state(self, state: bytes) -> None:
        epoch, index = map(int, state.decode().split())
        self._set(epoch, index)
        self._source.next_epoch = epoch + 1


def train(
    strategy: Any,
    directory: str,
    *,
    epochs: int,
    stateful: bool,
    kill_at: int | None = None,
    report: Callable[[int, float], None] = lambda step, loss: None,
    report_params: Callable[[Any], None] = lambda params: None,
    exit_code: int | None = 42,
    shuffle: str | None = None,
    kill_now: bool = False,
    source: str = "list",
) -> Any:
    """Train (resuming from `directory` if it holds a checkpoint); send this process SIGTERM, from
    another thread, once step `kill_at` has run (with `kill_now`, from this one: the save comes
    at the next step). `shuffle` ('seeded' or 'counter', one process): the batches in a `Shuffled`
    source. `source` 'grain' (one process): a Grain pipeline of the examples, one pass for all the
    epochs. Returns the PreemptionHandler."""
    num_pipelines, pipeline = jax.process_count(), jax.process_index()
    one_pass = source == "grain"  # All the epochs in one pass: the loop starts no new one.
    if one_pass:
        global_batch = EXAMPLES_PER_ELEMENT * strategy.num_replicas_in_sync
        x, y = (np.concatenate(parts) for parts in zip(*_elements(pipeline, 24), strict=True))
        dataset = strategy.experimental_distribute_dataset(
            _grain_epochs(list(zip(x, y, strict=True)), global_batch, epochs)
        )
    elif num_pipelines > 1 or stateful:
        contexts = []

        def dataset_fn(context: jaxstrategy.InputContext) -> Any:
            contexts.append(context)
            elements = _elements(context.input_pipeline_id, ELEMENTS_PER_PIPELINE)
            return (
                elements if num_pipelines > 1 and context.input_pipeline_id == 0 else EpochShuffled(elements)
            )

        dataset = strategy.distribute_datasets_from_function(dataset_fn)
    else:
        global_batch = EXAMPLES_PER_ELEMENT * strategy.num_replicas_in_sync
        x, y = (np.concatenate(parts) for parts in zip(*_elements(pipeline, 24), strict=True))
        batches = [(x[i : i + global_batch], y[i : i + global_batch]) for i in range(0, len(x), global_batch)]
        source = batches if shuffle is None else Shuffled(batches, counter=shuffle == "counter")
        dataset = strategy.experimental_distribute_dataset(source)
    if one_pass:
        steps_per_epoch = len(x) // global_batch
    elif dataset.cardinality >= 0:
        steps_per_epoch = len(dataset)
    else:
        # Each step takes one element per replica that this pipeline feeds: a process's replicas,
        # or one replica of a sharded job that spans processes (which then share the pipeline).
        (context,) = contexts
        steps_per_epoch = ELEMENTS_PER_PIPELINE * context.num_input_pipelines // context.num_replicas_in_sync

    params = strategy.init(init_params, jax.random.key(0))
    opt_state = strategy.init(OPTIMIZER.init, params)

    checkpointer = checkpoint.Checkpointer(directory)
    if shuffle == "seeded":
        # The pass the saved iterator is in: a save at a step that starts a pass holds the pass
        # before it, all taken.
        source.epoch = max((checkpointer.latest_step() or 0) - 1, 0) // steps_per_epoch
    handler = checkpoint.PreemptionHandler(checkpointer, strategy, exit_code=exit_code)
    iterator: Iterator[Any] = iter(dataset)
    restored = handler.restore({"params": params, "opt_state": opt_state, "data": iterator})
    params, opt_state = restored["params"], restored["opt_state"]
    if handler.step:
        print(f"resumed at step {handler.step}: {iterator.get_state()}", flush=True)  # type: ignore[attr-defined]
    print(f"holds {_rows_held(params['w'])} and {_rows_held(opt_state[0].trace['w'])} rows of w", flush=True)

    def saved() -> Any:
        return {"params": params, "opt_state": opt_state, "data": iterator}

    try:
        for step in handler.steps(epochs * steps_per_epoch, saved):
            if step % steps_per_epoch == 0 and step and not one_pass:
                if shuffle == "seeded":
                    source.epoch = step // steps_per_epoch
                iterator = iter(dataset)  # A new epoch: the next pass.
            params, opt_state, loss = strategy.run(train_step, args=(params, opt_state, next(iterator)))
            report(step, float(loss))
            if step == kill_at and kill_now:
                os.kill(os.getpid(), signal.SIGTERM)
            elif step == kill_at:
                # From another thread, as a scheduler's signal arrives: whenever it does.
                threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
        report_params(params)  # Trained to the end (a stop exits from the loop).
    finally:
        checkpointer.close()
    return handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument(
        "--strategy",
        choices=["one-device", "mirrored", "multi-worker", "multi-worker-sharded"],
        required=True,
    )
    parser.add_argument("--replicas", type=int, default=1, help="multi-worker-sharded: num_replicas")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--stateful", action="store_true")
    parser.add_argument("--kill-at", type=int, help="send SIGTERM to this process after this step")
    parser.add_argument("--kill-process", type=int, default=0, help="which process gets it (-1: all)")
    parser.add_argument("--kill-now", action="store_true", help="send it from the main thread")
    parser.add_argument("--shuffle", choices=["seeded", "counter"], help="shuffle the batches each pass")
    parser.add_argument("--source", choices=["list", "grain"], default="list", help="grain: a Grain pipeline")
    args = parser.parse_args()
    if args.strategy == "multi-worker":
        strategy: Any = jaxstrategy.MultiWorkerMirroredStrategy()  # First: it joins the job.
    elif args.strategy == "multi-worker-sharded":
        # Every leaf split that S divides (w over its rows); b, which no S divides, replicated on
        # purpose. With one replica over the job, each process holds half of w and its momentum.
        strategy = jaxstrategy.MultiWorkerShardedStrategy(
            num_replicas=args.replicas, min_shard_bytes=0, layout=[("b", PartitionSpec())]
        )
    elif args.strategy == "mirrored":
        strategy = jaxstrategy.MirroredStrategy()
    else:
        strategy = jaxstrategy.OneDeviceStrategy()
    kill_at = args.kill_at if args.kill_process in (jax.process_index(), -1) else None

    def report(step: int, loss: float) -> None:
        print(f"loss {step} {loss.hex()}", flush=True)

    def report_params(params: Any) -> None:
        # Each process holds only its devices' parts of a leaf split over the job: gather them.
        gathered = multihost_utils.process_allgather(params, tiled=True)
        for name, leaf in sorted(gathered.items()):
            print(f"param {name} {[float(x).hex() for x in np.asarray(leaf).flat]}", flush=True)

    train(
        strategy,
        args.directory,
        epochs=args.epochs,
        stateful=args.stateful,
        kill_at=kill_at,
        report=report,
        report_params=report_params,
        shuffle=args.shuffle,
        kill_now=args.kill_now,
        source=args.source,
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
