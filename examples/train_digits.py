"""Train a digit classifier through jaxstrategy: the demo that `make demo` runs.

A flax nnx MLP learns scikit-learn's bundled 8x8 digits (1,797 images; no download) on one device,
or with `--replicas N` on N devices through MirroredStrategy: only the constructor changes.
Batches come through `strategy.experimental_distribute_dataset`, which prefetches them onto the
device from a background thread; each training step updates the model and its optimizer in
place, as Flax writes it, compiled once by `strategy.run`; a `checkpoint.Checkpointer` saves
the model and optimizer every epoch in the background; at the end the newest checkpoint is
restored into fresh objects and evaluated again, and the loss curve is written as a PNG.

    make demo                                   # CPU, 10 epochs, well under a minute
    python examples/train_digits.py --help      # every flag
    python examples/train_digits.py --device /gpu:0 --epochs 20
    python examples/train_digits.py --replicas 4    # 4 GPUs, or 4 CPU devices on a laptop
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
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
    """A re-iterable source of (images, labels) batches: each pass is a new shuffle, as an epoch is.

    The last batch of a pass is smaller; the strategy pads it so that it splits over the replicas,
    and the training step counts only its real examples.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch_size: int, seed: int):
        self._images, self._labels = images, labels
        self._batch_size = batch_size
        self._rng = np.random.default_rng(seed)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        order = self._rng.permutation(len(self._labels))
        for start in range(0, len(order), self._batch_size):
            index = order[start : start + self._batch_size]
            yield self._images[index], self._labels[index]

    def __len__(self) -> int:
        return -(-len(self._labels) // self._batch_size)


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
    parser.add_argument("--epochs", type=int, default=10, help="passes over the training set")
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
        "--output-dir", type=Path, default=Path("demo_output"), help="where the checkpoints and loss curve go"
    )
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "hidden", "replicas"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.replicas is not None and args.batch_size % args.replicas:
        parser.error(f"--batch-size {args.batch_size} must be a multiple of --replicas {args.replicas}")
    if args.learning_rate is None:
        args.learning_rate = DEFAULT_LEARNING_RATES[args.optimizer]
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
    test_set = strategy.put((test_images, test_labels))

    losses: list[float] = []
    checkpoints = args.output_dir / "checkpoints"
    with checkpoint.Checkpointer(checkpoints, max_to_keep=2) as checkpointer:
        start = checkpointer.latest_step()
        if start is not None:  # A previous run's checkpoints: continue from them.
            # Into the live objects, in place.
            checkpointer.restore(strategy=strategy, target={"model": model, "optimizer": optimizer})
            print(f"resumed from the checkpoint of epoch {start}")
        first_epoch = 0 if start is None else start + 1
        for epoch in range(first_epoch, first_epoch + args.epochs):
            started, examples = time.perf_counter(), 0
            # disable=None: a live bar on a terminal, nothing in logs and pipes.
            progress = tqdm(
                dataset, total=len(dataset), desc=f"epoch {epoch + 1}", unit="step", leave=False, disable=None
            )
            for batch in progress:
                loss = strategy.run(train_step, args=(model, optimizer, batch))
                losses.append(float(loss))  # Reading the loss each step, as a progress bar does.
                # The real examples, one part per replica (the whole batch on one device).
                examples += sum(int(part.sum()) for part in strategy.experimental_local_results(batch[1]))
                rate = examples / (time.perf_counter() - started)
                progress.set_postfix(loss=f"{losses[-1]:.4f}", examples_per_s=f"{rate:.0f}", refresh=False)
            test_accuracy = float(strategy.run(accuracy, args=(model, *test_set)))
            print(
                f"epoch {epoch + 1}: loss {losses[-1]:.4f}, test accuracy {test_accuracy:.4f}, "
                f"{examples / (time.perf_counter() - started):.0f} examples/s"
            )
            # The objects' state, written in the background.
            checkpointer.save(epoch, {"model": model, "optimizer": optimizer})
        checkpointer.wait()
        latest = checkpointer.latest_step()
        restored, restored_optimizer = new_model(args, strategy)  # Fresh objects, then the checkpoint.
        checkpointer.restore(strategy=strategy, target={"model": restored, "optimizer": restored_optimizer})
    restored_accuracy = float(strategy.run(accuracy, args=(restored, *test_set)))
    print(f"test accuracy {test_accuracy:.4f}; ", end="")
    print(f"restored from the checkpoint of epoch {latest + 1}: {restored_accuracy:.4f}")
    write_loss_curve(losses, args.output_dir / "loss.png")
    print(f"wrote {args.output_dir / 'loss.png'} and checkpoints in {checkpoints}")
    return test_accuracy


def write_loss_curve(losses: list[float], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(losses, linewidth=1)
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
