"""What each process of a two-process job does for test_checkpoints_across_processes.py.

    python tests/checkpoint/across_processes_worker.py OUTPUT_DIR

Two processes of two CPU devices each. Every scenario runs in both, in the same order, and what a
process saw goes to OUTPUT_DIR/process-<index>.json; the checkpoints stay in OUTPUT_DIR for the
test to inspect and restore in one process. The layouts are those of a ShardedStrategy spanning
the job: 1x4 (one replica over all four devices, so each process holds half of each leaf) and 2x2
(each process one whole replica, split over its two devices), made here by hand.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import checkpointer, regions
from jaxstrategy._src.checkpoint.placement import Placement
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


def place(tree: dict[str, np.ndarray], sharding: Callable[[np.ndarray], jax.sharding.Sharding]) -> dict:
    return {
        name: jax.make_array_from_callback(value.shape, sharding(value), lambda index, v=value: v[index])
        for name, value in tree.items()
    }


@contextlib.contextmanager
def onto(layout: Callable[[Any], jax.sharding.Sharding], replicated: jax.sharding.Sharding) -> Iterator[None]:
    """Restores inside put each leaf where `layout` says: what MultiWorkerShardedStrategy's
    placement will do, which no strategy of this version does across processes."""
    original = checkpointer.placement_of

    def placement_of(strategy: Any) -> Placement:
        del strategy
        return Placement(replicated, lambda tree: jax.tree.map(layout, tree))

    checkpointer.placement_of = placement_of
    try:
        yield
    finally:
        checkpointer.placement_of = original


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
    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    me = jax.process_index()
    devices = np.array(strategy.devices)
    mesh14 = Mesh(devices.reshape(1, 4), ("replica", "shard"))
    mesh22 = Mesh(devices.reshape(2, 2), ("replica", "shard"))
    replicated = NamedSharding(mesh14, PartitionSpec())

    def rows14(x: Any) -> jax.sharding.Sharding:
        return NamedSharding(mesh14, PartitionSpec("shard")) if len(x.shape) else replicated

    def rows22(x: Any) -> jax.sharding.Sharding:
        return NamedSharding(mesh22, PartitionSpec("shard")) if len(x.shape) else replicated

    def columns14(x: Any) -> jax.sharding.Sharding:
        # Dimension 1 over all four devices where it divides (`w`), so that each saved region of
        # rows is split between the processes; else held whole.
        if len(x.shape) >= 2 and x.shape[1] % 4 == 0:
            return NamedSharding(mesh14, PartitionSpec(None, "shard"))
        return replicated

    seen: dict[str, Any] = {"process": me}
    expected = values()
    saved = place(expected, rows14)
    seen["saved_1x4"] = local_regions(saved)
    checkpoint.save(output / "split", saved, step=0)
    seen["saved_2x2"] = local_regions(place(expected, rows22))
    checkpoint.save(output / "replicas", place(expected, rows22), step=0)

    layouts = {"2x2": rows22, "replicated": lambda x: replicated, "columns": columns14}
    seen["restored"] = {}
    for name, layout in layouts.items():
        with onto(layout, replicated):
            restored = checkpoint.restore(output / "split")
        seen["restored"][name] = {
            "equal": equal_locally(restored, expected),
            "regions": local_regions(restored),
        }

    # Damage in process 1's part: the step's arrays replaced by those of a save in which one
    # element of rows 48:64 (process 1's last device's) differs, with the checksums kept.
    damaged = {**expected, "w": expected["w"].copy()}
    damaged["w"][50, 7] += 1
    checkpoint.save(output / "edited", place(damaged, rows14), step=0)
    barrier("edited")
    if me == 0:
        shutil.copytree(output / "split", output / "damaged")
        shutil.rmtree(output / "damaged" / "0" / "state")
        shutil.copytree(output / "edited" / "0" / "state", output / "damaged" / "0" / "state")
    barrier("damaged")
    seen["damaged"] = {}
    for name, layout in {"1x4": rows14, **layouts}.items():
        with onto(layout, replicated):
            seen["damaged"][name] = error_of(lambda: checkpoint.restore(output / "damaged"))

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
    checkpoint.save(output / "big", place(big, rows14), step=0)
    seen["bytes_read"] = {}
    for name, layout in {"1x4": rows14, "replicated": lambda x: replicated}.items():
        with onto(layout, replicated):
            barrier(f"read {name}")
            before = bytes_read()
            restored = checkpoint.restore(output / "big")
            seen["bytes_read"][name] = bytes_read() - before
        assert all(equal_locally(restored, big).values())
    state = output / "big" / "0" / "state"
    seen["big_stored_bytes"] = sum(path.stat().st_size for path in state.rglob("*") if path.is_file())
    (output / f"process-{me}.json").write_text(json.dumps(seen))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
