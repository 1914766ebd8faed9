"""Train one model with every process of a multi-worker job: MultiWorkerMirroredStrategy.

Every process runs this same script. The strategy finds the job (from `TF_CONFIG`, from JAX's
detection of a SLURM job, or from `--coordinator`, `--num-processes` and `--process-id`), joins
it, and trains a flax nnx MLP with optax on all the processes' devices as one program: each
process reads its own shard of every global batch through `distribute_datasets_from_function`,
gradients are averaged over all replicas, and the chief (process 0) prints the losses. With
`--checkpoint-dir` (a directory every process sees), every process takes part in saving the
final state: each writes the parts of the arrays it holds.

The data is synthetic (a random teacher labels Gaussian inputs), so nothing is downloaded, and
every global batch is the same whatever the number of processes and devices: with
`--strategy one-device` the same script trains on one device, on the same batches, and prints
the same losses.

Two processes on this machine, two CPU devices each (four replicas):

    CLUSTER='"cluster": {"worker": ["127.0.0.1:12345", "127.0.0.1:12346"]}'
    for i in 0 1; do
      env XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
        TF_CONFIG="{$CLUSTER, \"task\": {\"type\": \"worker\", \"index\": $i}}" \
        python examples/multi_worker.py &
    done; wait

The README shows the commands for hosts with GPUs, with `TF_CONFIG` and under SLURM.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import jax
import numpy as np
import optax

import jaxstrategy
from jaxstrategy import checkpoint

FEATURES, CLASSES = 32, 4


class MLP(nnx.Module):
    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(FEATURES, hidden, rngs=rngs)
        self.logits = nnx.Linear(hidden, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.logits(nnx.relu(self.hidden(x)))


def global_batch(step: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """Global batch `step`: the same on every process and for every strategy."""
    rng = np.random.default_rng([7, step])
    teacher = np.random.default_rng(0).normal(size=(FEATURES, CLASSES))
    images = rng.normal(size=(size, FEATURES)).astype(np.float32)
    return images, np.argmax(images @ teacher, axis=-1).astype(np.int32)


def make_dataset_fn(steps: int, global_batch_size: int) -> Any:
    def dataset_fn(context: jaxstrategy.InputContext) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """This input pipeline's elements: one per local replica per step, in replica order."""
        per_replica = context.get_per_replica_batch_size(global_batch_size)
        local = context.num_replicas_in_sync // context.num_input_pipelines
        first_replica = context.input_pipeline_id * local
        for step in range(steps):
            images, labels = global_batch(step, global_batch_size)
            for replica in range(first_replica, first_replica + local):
                rows = slice(replica * per_replica, (replica + 1) * per_replica)
                yield images[rows], labels[rows]

    return dataset_fn


def train_step(model: MLP, optimizer: nnx.Optimizer, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """One step, as Flax writes it: `model` and `optimizer` are updated in place."""
    images, labels = batch

    def loss_fn(model: MLP) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(model(images), labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    grads, loss = jaxstrategy.get_replica_context().all_reduce("mean", (grads, loss))
    optimizer.update(model, grads)
    return loss


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("multi-worker", "one-device"), default="multi-worker")
    parser.add_argument("--steps", type=int, default=50, help="training steps")
    parser.add_argument("--global-batch-size", type=int, default=64, help="examples per step, all replicas")
    parser.add_argument("--checkpoint-dir", type=Path, help="where to save the final state (seen by all)")
    job = parser.add_argument_group("the job, where neither TF_CONFIG nor JAX's detection gives it")
    job.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's host and a free port there")
    job.add_argument("--num-processes", type=int, help="how many processes")
    job.add_argument("--process-id", type=int, help="this process's index, from 0")
    args = parser.parse_args(argv)
    given = [args.coordinator, args.num_processes, args.process_id]
    if any(x is not None for x in given) and None in given:
        parser.error("--coordinator, --num-processes and --process-id go together")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.strategy == "multi-worker":
        resolver = None  # TF_CONFIG, or a job JAX detects.
        if args.coordinator is not None:
            resolver = jaxstrategy.SimpleClusterResolver(
                args.coordinator, args.num_processes, args.process_id
            )
        # First, before any other JAX call: joins the job.
        strategy: jaxstrategy.Strategy = jaxstrategy.MultiWorkerMirroredStrategy(resolver)
    else:
        strategy = jaxstrategy.OneDeviceStrategy()
    chief = strategy.extended.should_save_summary
    if chief:
        print(f"{strategy!r}: {strategy.num_replicas_in_sync} replicas")

    model = strategy.put(MLP(64, nnx.Rngs(0)))  # Replicated on every device of every process.
    optimizer = strategy.put(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    dataset = strategy.distribute_datasets_from_function(make_dataset_fn(args.steps, args.global_batch_size))
    for step, batch in enumerate(dataset):
        loss = strategy.run(train_step, args=(model, optimizer, batch))
        if chief:
            print(f"step {step}: loss {float(loss):.6f}")
    if args.checkpoint_dir is not None:
        # Every process takes part (each writes the parts of the arrays it holds); gating this on
        # `should_checkpoint` would leave the chief waiting for the others.
        saved = checkpoint.save(args.checkpoint_dir, {"model": model, "optimizer": optimizer})
        if chief:
            print(f"saved the final state as checkpoint {saved} in {args.checkpoint_dir}")


if __name__ == "__main__":
    main()
