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

Checksums: jaxstrategy saves a CRC32C of every array shard and JSON item, and checks them on
restore. Their cost is measured in pairs, one with them and one without (a private switch for the
save, `verify=False` for the restore), alternating which goes first, 3 pairs per round: the goals
are at most 10% on save and 15% on restore (the median of the pairs' ratios).

Preemption (`checkpoint.PreemptionHandler`): a child process trains on the same 100 MiB state
with a `DistributedIterator` over a list of batches, and gets SIGTERM mid-loop; the time from the
signal to the child's exit (status 42, the step finished, everything saved, the interpreter and
JAX shut down), then, in a new child, the time `PreemptionHandler.restore` takes (the 100 MiB
and the iterator's position, reached by skipping the batches taken) and the time from starting
the process to its first resumed step.

    python bench/checkpoint.py            # 5 rounds
    python bench/checkpoint.py --quick    # 1 round of 8 MiB, a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
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
from jaxstrategy._src.checkpoint import checksums

MIB = 2**20
TOTAL_MIB = 100
QUICK_MIB = 8  # The smoke test's tree: every path is taken, at a twelfth of the cost.
NUM_LEAVES = 21
GOAL_BLOCKING_FRACTION = 0.10
GOAL_RESTORE_RATIO = 1.5
GOAL_CHECKSUM_RATIO = {"save": 1.10, "restore": 1.15}
CHECKSUM_PAIRS_PER_ROUND = 3


def make_tree(strategy: jaxstrategy.OneDeviceStrategy, mib: int) -> dict[str, jax.Array]:
    """21 float32 leaves of uneven sizes adding up to `mib` MiB, like a model's parameters."""
    weights = np.arange(1, NUM_LEAVES + 1, dtype=np.float64)
    sizes = np.floor(weights / weights.sum() * mib * MIB / 4).astype(int)
    sizes[-1] += mib * MIB // 4 - sizes.sum()
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


def save_unchecked(tree: Any, directory: Path) -> None:
    checksums.write_checksums = False
    try:
        checkpoint.save(directory, tree, step=0)
    finally:
        checksums.write_checksums = True


def restore_unchecked(tree: Any, directory: Path, strategy: jaxstrategy.OneDeviceStrategy) -> Any:
    return checkpoint.restore(directory, strategy=strategy, target=tree, verify=False)


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


def measure_blocking(tree: Any, root: Path, *, with_checksums: bool = True) -> tuple[float, float]:
    """Seconds the caller waits in Checkpointer.save, and until the save is on disk."""
    checksums.write_checksums = with_checksums
    try:
        with checkpoint.Checkpointer(root / "async") as checkpointer:
            blocked, _ = timed(lambda: checkpointer.save(0, tree))
            written, _ = timed(checkpointer.wait)
    finally:
        checksums.write_checksums = True
    shutil.rmtree(root / "async")
    return blocked, blocked + written


def measure_checksums(
    tree: Any, root: Path, strategy: jaxstrategy.OneDeviceStrategy, pairs: int
) -> dict[str, list[float]]:
    """Per pair, with checksums / without: the save's time, the restore's, Checkpointer.save's wait."""
    ratios: dict[str, list[float]] = {"save": [], "restore": [], "Checkpointer.save blocks": []}
    for index in range(pairs):
        times: dict[bool, dict[str, float]] = {}
        for checked in (True, False) if index % 2 == 0 else (False, True):
            save, restore = (
                (save_jaxstrategy, restore_jaxstrategy) if checked else (save_unchecked, restore_unchecked)
            )
            directory = root / f"checksums-{checked}"
            save_s, _ = timed(lambda save=save, directory=directory: save(tree, directory))
            restore_s, _ = timed(
                lambda restore=restore, directory=directory: restore(tree, directory, strategy)
            )
            blocked_s, _ = measure_blocking(tree, root, with_checksums=checked)
            times[checked] = {"save": save_s, "restore": restore_s, "Checkpointer.save blocks": blocked_s}
            shutil.rmtree(directory)
        for what, values in ratios.items():
            values.append(times[True][what] / times[False][what])
    return ratios


def report_checksums(ratios: dict[str, list[float]]) -> None:
    print()
    print(f"checksums, with / without, {len(ratios['save'])} pairs: median (quartiles)")
    for what, values in ratios.items():
        low, _, high = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
        goal = f"; goal <= {GOAL_CHECKSUM_RATIO[what]:.2f}" if what in GOAL_CHECKSUM_RATIO else ""
        print(f"  {what}: {statistics.median(values):.3f} ({low:.2f}-{high:.2f}{goal})")


# --- preemption: SIGTERM to a clean exit, and the resume -------------------------------------------

PREEMPTION_BATCHES = 200_000  # The list the child's iterator reads; it never reaches its end.
_START_ENV = "JAXSTRATEGY_BENCH_STARTED"


def _bench_step(total: jax.Array, batch: jax.Array) -> jax.Array:
    return total + batch.sum()


def preemption_child(directory: str, mib: int) -> None:
    """A training loop under a PreemptionHandler, saving the `mib` MiB tree and an iterator; it
    prints one JSON line once its first step (resumed or not) ran, and trains until stopped."""
    started = float(os.environ[_START_ENV])
    strategy = jaxstrategy.OneDeviceStrategy()
    tree = make_tree(strategy, mib)
    dataset = strategy.experimental_distribute_dataset(
        [np.full(4, i, np.float32) for i in range(PREEMPTION_BATCHES)]
    )
    iterator = iter(dataset)
    total = strategy.put(np.zeros((), np.float32))
    with checkpoint.Checkpointer(directory) as checkpointer:
        handler = checkpoint.PreemptionHandler(checkpointer, strategy)
        restore_s, restored = timed(
            lambda: handler.restore({"params": tree, "total": total, "data": iterator})
        )
        tree, total = restored["params"], restored["total"]
        first = handler.step

        def saved() -> dict[str, Any]:
            return {"params": tree, "total": total, "data": iterator}

        for step in handler.steps(PREEMPTION_BATCHES, saved):
            total = strategy.run(_bench_step, args=(total, next(iterator)))
            if step == first:
                jax.block_until_ready(total)
                report = {"resumed_at": first, "restore_s": restore_s, "first_step_s": time.time() - started}
                print(json.dumps(report), flush=True)


def _start_child(directory: Path, mib: int) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = {**os.environ, _START_ENV: repr(time.time())}
    child = subprocess.Popen(
        [sys.executable, __file__, "--preemption-child", str(directory), "--mib", str(mib)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        raise RuntimeError(f"the preemption child failed:\n{child.communicate(timeout=60)[1]}")
    return child, json.loads(line)


def measure_preemption(root: Path, rounds: int, mib: int) -> list[dict[str, float]]:
    """Per round: SIGTERM to exit, the handler's save, and the resumed run's restore and first step."""
    results = []
    for round_index in range(rounds):
        directory = root / f"preemption-{round_index}"
        child, _ = _start_child(directory, mib)
        time.sleep(1.0)  # Training, well past the first steps.
        signalled = time.perf_counter()
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=300)
        exit_s = time.perf_counter() - signalled
        saved = re.search(r"saved step (\d+) to .* in ([0-9.]+) s", stderr)
        if child.returncode != checkpoint.PREEMPTED_EXIT_CODE or saved is None:
            raise RuntimeError(f"the preemption child ended with status {child.returncode}:\n{stderr}")
        resumed, report = _start_child(directory, mib)
        resumed.kill()
        resumed.communicate(timeout=60)
        assert report["resumed_at"] == int(saved.group(1)), (report, saved.group(0))
        results.append(
            {
                "steps": report["resumed_at"],
                "exit_s": exit_s,
                "save_s": float(saved.group(2)),
                "restore_s": report["restore_s"],
                "first_step_s": report["first_step_s"],
            }
        )
        shutil.rmtree(directory)
    return results


def report_preemption(results: list[dict[str, float]], mib: int) -> None:
    def median(key: str) -> float:
        return statistics.median(result[key] for result in results)

    print()
    print(
        f"preemption, {mib} MiB and an iterator {median('steps'):.0f} batches in (median of "
        f"{len(results)}): SIGTERM to a clean exit {median('exit_s'):.2f} s (the save "
        f"{median('save_s'):.2f} s of it); resume: restore {median('restore_s'):.2f} s, process start "
        f"to the first resumed step {median('first_step_s'):.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help=f"one round of {QUICK_MIB} MiB, as a smoke test")
    parser.add_argument("--mib", type=int, help=f"the tree's size (default {TOTAL_MIB} MiB)")
    parser.add_argument("--preemption-child", metavar="DIRECTORY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.preemption_child:
        preemption_child(args.preemption_child, args.mib)
        return
    rounds = 1 if args.quick else args.rounds
    mib = args.mib or (QUICK_MIB if args.quick else TOTAL_MIB)

    strategy = jaxstrategy.OneDeviceStrategy()
    tree = make_tree(strategy, mib)
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
        checksum_ratios = measure_checksums(tree, root, strategy, CHECKSUM_PAIRS_PER_ROUND * rounds)

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
    report_checksums(checksum_ratios)
    with tempfile.TemporaryDirectory() as scratch:
        report_preemption(measure_preemption(Path(scratch), rounds, mib), mib)


if __name__ == "__main__":
    main()
