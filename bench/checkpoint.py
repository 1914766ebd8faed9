"""Measure checkpoint save and restore of a 100 MiB pytree: jaxstrategy against msgpack and np.savez.

Three ways to save a pytree of 21 float32 arrays (100 MiB, on the strategy's device) to local
disk and read it back onto the device, interleaved round by round so that a noisy machine drifts
equally on all of them:

* jaxstrategy: `checkpoint.save` (returns when the files are on disk) and `checkpoint.restore`
  with a target, which reads every leaf straight onto the strategy's device;
* msgpack: `flax.serialization.to_bytes` written to one file, read back with `from_bytes` and
  placed with `jax.device_put`;
* np.savez: the floor, an uncompressed .npz of the flattened leaves, `np.load` and `device_put`.

It also times what a training loop waits for when it saves with `checkpoint.Checkpointer`: the
`save(step, tree)` call returns once the arrays are copied off the device and the files are
written in the background. The goals: that wait is under 10% of the synchronous save, and
restore is within 1.5x of the np.load floor. The files were just written, so restores read from
the page cache for every method alike.

    python bench/checkpoint.py            # 5 rounds
    python bench/checkpoint.py --quick    # 1 round, a smoke test
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.serialization
import jax
import numpy as np

import jaxstrategy
from jaxstrategy import checkpoint

MIB = 2**20
TOTAL_MIB = 100
NUM_LEAVES = 21
GOAL_BLOCKING_FRACTION = 0.10
GOAL_RESTORE_RATIO = 1.5


def make_tree(strategy: jaxstrategy.OneDeviceStrategy) -> dict[str, jax.Array]:
    """21 float32 leaves of uneven sizes adding up to 100 MiB, like a model's parameters."""
    weights = np.arange(1, NUM_LEAVES + 1, dtype=np.float64)
    sizes = np.floor(weights / weights.sum() * TOTAL_MIB * MIB / 4).astype(int)
    sizes[-1] += TOTAL_MIB * MIB // 4 - sizes.sum()
    rng = np.random.default_rng(0)
    host = {f"layer{i:02d}": rng.standard_normal(size, dtype=np.float32) for i, size in enumerate(sizes)}
    return strategy.put(host)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = jax.block_until_ready(fn())
    return time.perf_counter() - start, result


def save_jaxstrategy(tree: Any, directory: Path) -> None:
    checkpoint.save(directory, tree, step=0)


def restore_jaxstrategy(tree: Any, directory: Path, strategy: jaxstrategy.OneDeviceStrategy) -> Any:
    return checkpoint.restore(directory, strategy=strategy, target=tree)


def save_msgpack(tree: Any, directory: Path) -> None:
    directory.mkdir()
    (directory / "state.msgpack").write_bytes(flax.serialization.to_bytes(tree))


def restore_msgpack(tree: Any, directory: Path, strategy: jaxstrategy.OneDeviceStrategy) -> Any:
    restored = flax.serialization.from_bytes(tree, (directory / "state.msgpack").read_bytes())
    return jax.device_put(restored, strategy.sharding)


def save_npz(tree: Any, directory: Path) -> None:
    directory.mkdir()
    np.savez(directory / "state.npz", **{name: np.asarray(leaf) for name, leaf in tree.items()})


def restore_npz(tree: Any, directory: Path, strategy: jaxstrategy.OneDeviceStrategy) -> Any:
    with np.load(directory / "state.npz") as saved:
        host = {name: saved[name] for name in tree}
    return jax.device_put(host, strategy.sharding)


METHODS = {
    "jaxstrategy": (save_jaxstrategy, restore_jaxstrategy),
    "msgpack": (save_msgpack, restore_msgpack),
    "np.savez": (save_npz, restore_npz),
}


def check_round_trip(restored: Any, tree: Any, strategy: jaxstrategy.OneDeviceStrategy) -> None:
    for name, leaf in tree.items():
        assert restored[name].devices() == {strategy.device}, name
        assert np.array_equal(np.asarray(restored[name]), np.asarray(leaf)), name


def measure_blocking(tree: Any, root: Path) -> tuple[float, float]:
    """Seconds the caller waits in Checkpointer.save, and until the save is on disk."""
    with checkpoint.Checkpointer(root / "async") as checkpointer:
        blocked, _ = timed(lambda: checkpointer.save(0, tree))
        written, _ = timed(checkpointer.wait)
    shutil.rmtree(root / "async")
    return blocked, blocked + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one round, as a smoke test")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds

    strategy = jaxstrategy.OneDeviceStrategy()
    tree = make_tree(strategy)
    size_mib = sum(leaf.nbytes for leaf in tree.values()) / MIB
    saves: dict[str, list[float]] = {name: [] for name in METHODS}
    restores: dict[str, list[float]] = {name: [] for name in METHODS}
    blocking: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for warmup_name, (save, restore) in METHODS.items():  # First calls compile and import.
            save(tree, root / f"warmup-{warmup_name}")
            check_round_trip(restore(tree, root / f"warmup-{warmup_name}", strategy), tree, strategy)
        for round_index in range(rounds):
            names = list(METHODS)
            names = names[round_index % len(names) :] + names[: round_index % len(names)]  # Rotate the order.
            for name in names:
                save, restore = METHODS[name]
                directory = root / f"{name}-{round_index}"
                seconds, _ = timed(lambda save=save, directory=directory: save(tree, directory))
                saves[name].append(seconds)
                seconds, restored = timed(
                    lambda restore=restore, directory=directory: restore(tree, directory, strategy)
                )
                restores[name].append(seconds)
                del restored
                shutil.rmtree(directory)
            blocking.append(measure_blocking(tree, root))

    print(
        f"jax {jax.__version__}; {size_mib:.0f} MiB in {NUM_LEAVES} float32 leaves on {strategy.device}; "
        f"{rounds} interleaved rounds; medians"
    )
    print()
    floor_save = statistics.median(saves["np.savez"])
    floor_restore = statistics.median(restores["np.savez"])
    header = ("method", "save MiB/s", "save s", "vs floor", "restore MiB/s", "restore s", "vs floor")
    print(
        "".join(f"{title:<14}" if i == 0 else f"{title:>{len(title) + 3}}" for i, title in enumerate(header))
    )
    for name in METHODS:
        save_s, restore_s = statistics.median(saves[name]), statistics.median(restores[name])
        print(
            f"{name:<14}{size_mib / save_s:>12.0f}{save_s:>9.3f}{save_s / floor_save:>9.2f}x"
            f"{size_mib / restore_s:>15.0f}{restore_s:>11.3f}{restore_s / floor_restore:>9.2f}x"
        )
    blocked = statistics.median(b for b, _ in blocking)
    total = statistics.median(t for _, t in blocking)
    sync_save = statistics.median(saves["jaxstrategy"])
    print()
    print(f"Checkpointer.save blocks the loop for {blocked:.3f} s; the write ends after {total:.3f} s.")
    print(f"blocking / synchronous save: {blocked / sync_save:.2f} (goal < {GOAL_BLOCKING_FRACTION:.2f})")
    restore_ratio = statistics.median(restores["jaxstrategy"]) / floor_restore
    print(f"restore / np.load floor: {restore_ratio:.2f} (goal <= {GOAL_RESTORE_RATIO})")


if __name__ == "__main__":
    main()
