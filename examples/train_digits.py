"""Train a digit classifier through jaxstrategy: the demo that `make demo` runs.

A flax nnx MLP learns scikit-learn's bundled 8x8 digits (1,797 images; no download) on one device,
or with `--replicas N` on N devices through MirroredStrategy: only the constructor changes.
Batches come through `strategy.experimental_distribute_dataset`, which prefetches them onto the
device from a background thread; each training step updates the model and its optimizer in
place, as Flax writes it, compiled once by `strategy.run`; a `checkpoint.Checkpointer` saves
the model, the optimizer and the input's position every epoch in the background; at the end the
newest checkpoint is restored into fresh objects and evaluated again, and the loss curve is
written as a PNG.

Ctrl-C or SIGTERM (what a cluster sends before it stops a job) finishes the step, saves
everything, the batch the input stands at included, and exits with status 42; running the same
command again resumes at that batch, mid-epoch, and trains exactly as if it had never stopped.

    make demo                                   # CPU, 10 epochs, well under a minute
    python examples/train_digits.py --help      # every flag
    python examples/train_digits.py --device /gpu:0 --epochs 20
    python examples/train_digits.py --replicas 4    # 4 GPUs, or 4 CPU devices on a laptop
    python examples/train_digits.py --preempt-at 100; python examples/train_digits.py   # resumes
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy.testing import force_cpu_devices

matplotlib.use("Agg")  # Write files; never open a window.
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

NUM_CLASSES = 10
# The accuracy this demo is expected to reach with its default flags.
TARGET_ACCURACY = 0.95
OPTIMIZERS = {"adam": optax.adam, "sgd": optax.sgd}
DEFAULT_LEARNING_RATES = {"adam": 3e-3, "sgd": 0.1}


class MLP(nnx.Module):
    """64 pixels -> two hidden layers -> 10 class logits."""

    def __init__(self, hidden: int, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(64, hidden, rngs=rngs)
        self.hidden2 = nnx.Linear(hidden, hidden, rngs=rngs)
        self.logits = nnx.Linear(hidden, NUM_CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.hidden1(x))
        x = nnx.relu(self.hidden2(x))
        return self.logits(x)


class ShuffledBatches:
    """A re-iterable source of (images, labels) batches: each pass is an epoch, in its own order.

    The last batch of a pass is smaller; the strategy pads it so that it splits over the replicas,
    and the training step counts only its real examples. Each epoch's order is a function of the
    seed and the epoch, and a pass's iterator has `get_state()` / `set_state()` (the protocol of
    Grain's iterators), so a checkpoint restores an epoch at the batch it stopped at without
    reading the batches before it.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int):
        self.images, self.labels = images, labels
        self.batch_size = batch_size
        self.seed = seed
        self.next_epoch = 0

    def __iter__(self) -> Epoch:
        epoch = Epoch(self, self.next_epoch)
        self.next_epoch += 1
        return epoch

    def __len__(self) -> int:
        return -(-len(self.labels) // self.batch_size)


class Epoch:
    """One pass over the training set: its batches in the epoch's order."""

    def __init__(self, source: ShuffledBatches, epoch: int):
        self._source = source
        self._start(epoch, 0)

    def _start(self, epoch: int, batch: int) -> None:
        self.epoch, self.batch = epoch, batch
        # The epoch-th shuffle drawn from one generator, as drawing one per epoch gives.
        rng = np.random.default_rng(self._source.seed)
        for _ in range(epoch + 1):
            self._order = rng.permutation(len(self._source.labels))

    def __iter__(self) -> Epoch:
        return self

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        start = self.batch * self._source.batch_size
        if start >= len(self._order):
            raise StopIteration
        self.batch += 1
        index = self._order[start : start + self._source.batch_size]
        return self._source.images[index], self._source.labels[index]

    def get_state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    def set_state(self, state: dict[str, int]) -> None:
        self._start(state["epoch"], state["batch"])
        self._source.next_epoch = state["epoch"] + 1


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train an MLP on scikit-learn's digits with jaxstrategy and report test accuracy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    placement = parser.add_mutually_exclusive_group()
    placement.add_argument(
        "--device", default="/cpu:0", help="the device to train on: /cpu:0, /gpu:0, cuda:1, ..."
    )
    placement.add_argument(
        "--replicas",
        type=int,
        help="train on this many devices with MirroredStrategy (on a machine without "
        "accelerators, as many CPU devices)",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=10,
        help="passes over the training set, in all: a run that resumes from --output-dir's checkpoints "
        "trains until this many are done",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="examples per training step")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam", help="the optimizer")
    parser.add_argument(
        "--learning-rate",
        type=float,
        help="the optimizer's learning rate (default: "
        + ", ".join(f"{rate:g} with {name}" for name, rate in sorted(DEFAULT_LEARNING_RATES.items()))
        + ")",
    )
    parser.add_argument("--hidden", type=int, default=256, help="width of the two hidden layers")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the shuffles and the weights")
    parser.add_argument(
        "--output-dir",
        type=Path,
        help="where the checkpoints and loss curve go (default: demo_output/one_device, or "
        "demo_output/N_replicas with --replicas N, so that each placement trains its own run)",
    )
    parser.add_argument(
        "--preempt-at",
        type=int,
        metavar="STEP",
        help="send this process SIGTERM once this training step has run, as a cluster would, to try "
        "the exact resume: run the same command again without it",
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden", "replicas"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.replicas is not None and args.batch_size % args.replicas:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of --replicas {args.replicas}")
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
    if args.output_dir is None:
        # One folder per placement: a run on four replicas after one on one device would otherwise
        # find all its epochs trained already, in the first run's checkpoints.
        placement = "one_device" if args.replicas is None else f"{args.replicas}_replicas"
        args.output_dir = Path("demo_output") / placement
    return args


def load_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as float32 pixels in [0, 1] and int32 labels, split 80/20 with every class in both."""
    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)
    return train_test_split(images, labels, test_size=0.2, random_state=seed, stratify=labels)


def train_step(model: MLP, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
    """One step, as Flax's documentation writes it: `model` and `optimizer` are updated in place."""
    (images, labels), mask = batch  # The mask marks the real examples of a padded batch.
    context = jaxstrategy.get_replica_context()
    # Each replica divides its examples' summed loss by the number of examples in the whole
    # batch, and the replicas' gradients are summed: the gradient of the batch's mean loss, on any
    # number of replicas (TensorFlow's idiom; on one device the sums are no-ops).
    examples = context.all_reduce("sum", jnp.sum(mask, dtype=jnp.int32))

    def loss_fn(model: MLP) -> jax.Array:
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(images), labels)
        return jaxstrategy.nn.compute_average_loss(
            per_example, sample_weight=mask, global_batch_size=examples
        )

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    loss, grads = context.all_reduce("sum", (loss, grads))
    optimizer.update(model, grads)
    return loss


def accuracy(model: MLP, images: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(jnp.argmax(model(images), axis=-1) == labels)


def new_model(args: argparse.Namespace, strategy: jaxstrategy.Strategy) -> tuple[MLP, nnx.Optimizer]:
    """The model and its optimizer, their Variables committed to the strategy's devices."""
    model = strategy.put(MLP(args.hidden, nnx.Rngs(args.seed)))
    optimizer = OPTIMIZERS[args.optimizer](args.learning_rate)
    return model, strategy.put(nnx.Optimizer(model, optimizer, wrt=nnx.Param))


def make_strategy(args: argparse.Namespace) -> jaxstrategy.OneDeviceStrategy | jaxstrategy.MirroredStrategy:
    if args.replicas is None:
        return jaxstrategy.OneDeviceStrategy(args.device)
    devices = jax.local_devices()
    if len(devices) < args.replicas:
        raise SystemExit(f"error: --replicas {args.replicas}, but this machine has {len(devices)} devices")
    return jaxstrategy.MirroredStrategy(devices[: args.replicas])


def train(args: argparse.Namespace) -> float:
    strategy = make_strategy(args)
    train_images, test_images, train_labels, test_labels = load_data(args.seed)
    print(f"{strategy!r}: {len(train_labels)} training and {len(test_labels)} test images")

    model, optimizer = new_model(args, strategy)
    batches = ShuffledBatches(train_images, train_labels, args.batch_size, args.seed)
    # A last batch that does not split over the replicas is padded, with a mask of its real examples.
    dataset = strategy.experimental_distribute_dataset(batches, jaxstrategy.InputOptions(partial_batch="pad"))
    steps_per_epoch = len(dataset)
    test_set = strategy.put((test_images, test_labels))
    iterator = iter(dataset)

    def saved() -> dict[str, Any]:
        """What a checkpoint holds: the objects' state, and where the input stands."""
        return {"model": model, "optimizer": optimizer, "data": iterator}

    losses: list[float] = []
    checkpoints = args.output_dir / "checkpoints"
    with (
        checkpoint.Checkpointer(checkpoints, max_to_keep=2) as checkpointer,
        # Ctrl-C or SIGTERM: finish the step, save (the input's position too), exit with status 42.
        checkpoint.PreemptionHandler(
            checkpointer, strategy, signals=(signal.SIGINT, signal.SIGTERM)
        ) as handler,
    ):
        handler.restore(saved())  # A previous run's newest checkpoint, into the live objects and iterator.
        first_step = handler.step
        if first_step >= args.epochs * steps_per_epoch:
            print(
                f"all {args.epochs} epochs were trained already (step {first_step} in {checkpoints}); "
                f"evaluating that. Delete {checkpoints} to train again, or pass a larger --epochs."
            )
        elif first_step:
            epoch, batch = divmod(first_step, steps_per_epoch)
            print(
                f"resumed at epoch {epoch + 1}, batch {batch} of {steps_per_epoch} (step {first_step}), "
                f"from {checkpoints}"
            )
        steps = handler.steps(args.epochs * steps_per_epoch, saved)
        for epoch in range(first_step // steps_per_epoch, args.epochs):
            if handler.step % steps_per_epoch == 0 and handler.step:
                iterator = iter(dataset)  # The next epoch; a resumed one goes on in the restored iterator.
            started, examples = time.perf_counter(), 0
            # disable=None: a live bar on a terminal, nothing in logs and pipes.
            progress = tqdm(
                total=steps_per_epoch,
                initial=handler.step % steps_per_epoch,
                desc=f"epoch {epoch + 1}",
                unit="step",
                leave=False,
                disable=None,
            )
            for step in itertools.islice(steps, steps_per_epoch - handler.step % steps_per_epoch):
                batch = next(iterator)  # Taken after the step boundary, where a preemption saves.
                loss = strategy.run(train_step, args=(model, optimizer, batch))
                losses.append(float(loss))  # Reading the loss each step, as a progress bar does.
                # The real examples, one part per replica (the whole batch on one device).
                examples += sum(int(part.sum()) for part in strategy.experimental_local_results(batch[1]))
                rate = examples / (time.perf_counter() - started)
                progress.update()
                progress.set_postfix(loss=f"{losses[-1]:.4f}", examples_per_s=f"{rate:.0f}", refresh=False)
                if step == args.preempt_at:
                    threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGTERM)).start()
            progress.close()
            test_accuracy = float(strategy.run(accuracy, args=(model, *test_set)))
            print(
                f"epoch {epoch + 1}: loss {losses[-1]:.4f}, test accuracy {test_accuracy:.4f}, "
                f"{examples / (time.perf_counter() - started):.0f} examples/s"
            )
            # The objects' state and the input's position, written in the background.
            checkpointer.save(handler.step, saved())
        checkpointer.wait()
        latest = checkpointer.latest_step()
        assert latest is not None  # At least one epoch was trained and saved.
        restored, restored_optimizer = new_model(args, strategy)  # Fresh objects, then the checkpoint.
        with iter(dataset) as spare:
            checkpointer.restore(
                strategy=strategy, target={"model": restored, "optimizer": restored_optimizer, "data": spare}
            )
    test_accuracy = float(strategy.run(accuracy, args=(model, *test_set)))
    restored_accuracy = float(strategy.run(accuracy, args=(restored, *test_set)))
    print(f"test accuracy {test_accuracy:.4f}; ", end="")
    print(f"restored from the checkpoint of epoch {latest // steps_per_epoch}: {restored_accuracy:.4f}")
    if losses:
        write_loss_curve(losses, first_step, args.output_dir / "loss.png")
        print(f"wrote {args.output_dir / 'loss.png'} and checkpoints in {checkpoints}")
    return test_accuracy


def write_loss_curve(losses: list[float], first_step: int, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(range(first_step, first_step + len(losses)), losses, linewidth=1)
    axes.set(
        xlabel="training step", ylabel="cross-entropy loss", yscale="log", title="digits MLP, jaxstrategy"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replicas is not None:
        # Before JAX starts: without accelerators, the CPU presents this many devices. With them,
        # it changes nothing, since MirroredStrategy takes the default (accelerator) devices.
        force_cpu_devices(args.replicas)
    try:
        test_accuracy = train(args)
    except jaxstrategy.InvalidDeviceError as error:
        raise SystemExit(f"error: {error}") from None
    verdict = "reached" if test_accuracy >= TARGET_ACCURACY else "did NOT reach"
    print(f"{verdict} the target accuracy of {TARGET_ACCURACY}")


if __name__ == "__main__":
    main()
