"""What each process of a two-process job does for test_checkpoints_across_processes.py.

    python tests/checkpoint/across_processes_worker.py OUTPUT_DIR

Two processes of two CPU devices each. Every scenario runs in both, in the same order, and what a
process saw goes to OUTPUT_DIR/process-<index>.json; the checkpoints stay in OUTPUT_DIR for the
test to inspect and restore in one process. The layouts are those of MultiWorkerShardedStrategy:
1x4 (one replica over all four devices, so each process holds half of each leaf), 2x2 (each
process one whole replica, split over its two devices) and 1x4 by columns, each leaf's rows (or
columns) split by a layout rule; and MultiWorkerMirroredStrategy's, every leaf whole everywhere.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import regions
from jaxstrategy._src.cluster import coordination

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_util import bytes_read  # noqa: E402

# The saved values: every element differs; dimensions other than the split one are odd.
SHAPES = {"w": ((64, 36), np.float32), "m": ((8, 1001), np.int32), "v": ((4, 5, 3), np.float32)}
# The tree whose restores are measured: 32 MiB of random floats, which zstd cannot shrink.
BIG_LEAVES, BIG_SHAPE = 4, (1024, 2048)


def values() -> dict[str, np.ndarray]:
    tree = {
        name: (np.arange(np.prod(shape)).reshape(shape) * 7 + 3 * i).astype(dtype)
        for i, (name, (shape, dtype)) in enumerate(SHAPES.items())
    }
    tree["w"] = tree["w"] * np.float32(0.25) - 100
    return tree


def big_values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"big{i}": rng.standard_normal(BIG_SHAPE, dtype=np.float32) for i in range(BIG_LEAVES)}


def local_regions(tree: dict[str, jax.Array]) -> dict[str, list[str]]:
    return {
        name: sorted({regions.key(regions.region_of(s.index, leaf.shape)) for s in leaf.addressable_shards})
        for name, leaf in tree.items()
    }


def equal_locally(restored: dict[str, jax.Array], expected: dict[str, np.ndarray]) -> dict[str, bool]:
    """Whether every local shard of each leaf holds the saved values, and the leaf its dtype."""
    return {
        name: restored[name].dtype == value.dtype
        and restored[name].shape == value.shape
        and all(np.array_equal(np.asarray(s.data), value[s.index]) for s in restored[name].addressable_shards)
        for name, value in expected.items()
    }


def barrier(name: str) -> None:
    coordination.every_process_value(name, caller=name, timeout_s=120)


def error_of(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def main(output: Path) -> None:
    strategy = jaxstrategy.MultiWorkerMirroredStrategy()  # Every leaf whole on every device.
    me = jax.process_index()

    def sharded(replicas: int, rules: list[tuple[str, PartitionSpec]]) -> jaxstrategy.Strategy:
        return jaxstrategy.MultiWorkerShardedStrategy(num_replicas=replicas, layout=rules, min_shard_bytes=0)

    rows = [(".*", PartitionSpec("shard"))]
    rows14, rows22 = sharded(1, rows), sharded(2, rows)
    # `w`'s columns over all four devices, so that each saved region of rows is split between
    # the processes.
    columns14 = sharded(1, [("w", PartitionSpec(None, "shard")), ("m|v", PartitionSpec())])

    seen: dict[str, Any] = {"process": me}
    expected = values()
    saved = rows14.put(expected)
    seen["saved_1x4"] = local_regions(saved)
    checkpoint.save(output / "split", saved, step=0)
    seen["saved_2x2"] = local_regions(rows22.put(expected))
    checkpoint.save(output / "replicas", rows22.put(expected), step=0)

    layouts = {"2x2": rows22, "replicated": strategy, "columns": columns14}
    seen["restored"] = {}
    for name, layout in layouts.items():
        restored = checkpoint.restore(output / "split", strategy=layout)
        seen["restored"][name] = {
            "equal": equal_locally(restored, expected),
            "regions": local_regions(restored),
        }

    # Damage in process 1's part: the step's arrays replaced by those of a save in which one
    # element of rows 48:64 (process 1's last device's) differs, with the checksums kept.
    damaged = {**expected, "w": expected["w"].copy()}
    damaged["w"][50, 7] += 1
    checkpoint.save(output / "edited", rows14.put(damaged), step=0)
    barrier("edited")
    if me == 0:
        shutil.copytree(output / "split", output / "damaged")
        shutil.rmtree(output / "damaged" / "0" / "state")
        shutil.copytree(output / "edited" / "0" / "state", output / "damaged" / "0" / "state")
    barrier("damaged")
    seen["damaged"] = {}
    for name, layout in {"1x4": rows14, **layouts}.items():
        seen["damaged"][name] = error_of(
            lambda layout=layout: checkpoint.restore(output / "damaged", strategy=layout)
        )

    # Positions that differ between the processes: each iterator has taken its own batches.
    batches = [np.full(2, i, np.float32) for i in range(8)]
    dataset = strategy.distribute_datasets_from_function(
        lambda context: [b + 100 * context.input_pipeline_id for b in batches]
    )
    iterator = iter(dataset)
    next(iterator)
    seen["iterator_state"] = iterator.get_state()
    checkpoint.save(
        output / "iterators", {"w": strategy.put(np.ones(3, np.float32)), "data": iterator}, step=0
    )

    # Bytes read restoring 32 MiB saved split over the four devices.
    big = big_values()
    checkpoint.save(output / "big", rows14.put(big), step=0)
    seen["bytes_read"] = {}
    for name, layout in {"1x4": rows14, "replicated": strategy}.items():
        barrier(f"read {name}")
        before = bytes_read()
        restored = checkpoint.restore(output / "big", strategy=layout)
        seen["bytes_read"][name] = bytes_read() - before
        assert all(equal_locally(restored, big).values())
    state = output / "big" / "0" / "state"
    seen["big_stored_bytes"] = sum(path.stat().st_size for path in state.rglob("*") if path.is_file())
    (output / f"process-{me}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
