"""Checkpoints of arrays split across the processes of a job: who writes, who checks, who reads what.

One job of two processes of two CPU devices each (across_processes_worker.py) saves arrays laid
out as a ShardedStrategy spanning the job would hold them, 1x4 (each process half of each leaf)
and 2x2 (each process a whole replica), and restores them onto other layouts; this process then
inspects its files and restores them alone. The job runs once for the module (about 7 s).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import tensorstore as ts

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import regions
from jaxstrategy.testing import run_local_workers

WORKER = Path(__file__).with_name("across_processes_worker.py")
# The damaged-bytes message for `where` (a pattern): exactly the `lines` listed, then the fix.
_DAMAGED = (
    r"(?s)step 0 in {where}: the bytes read .* differ .*:\n{lines}\n"
    r"Restore another step, or restore with verify=False"
)
_W_DAMAGED = r"  w\[48:64, 0:36\]: crc32c 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}"


def _worker_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("across_processes_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[list[dict], Path]:
    """What each process of the job saw, and the folder of its checkpoints."""
    output = tmp_path_factory.mktemp("across_processes")
    results = run_local_workers([str(WORKER), str(output)], devices_per_worker=2, timeout=240)
    if any(result.returncode != 0 for result in results):
        pytest.fail("a worker failed:\n" + "\n".join(result.stderr[-3000:] for result in results))
    return [json.loads((output / f"process-{i}.json").read_text()) for i in range(2)], output


def _checksum_regions(step: Path, process: int) -> dict[str, set[str]]:
    content = json.loads((step / "checksums" / f"process_{process}-of-2.json").read_text())
    return {name: set(by_region) for name, by_region in content["leaves"].items()}


def _written_regions(step: Path, process: int) -> dict[str, set[str]]:
    """The regions of the chunks in the process's own OCDBT database: the bytes it wrote."""
    state = step / "state"
    root = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{state}"}).result()
    own = ts.KvStore.open(
        {"driver": "ocdbt", "base": f"file://{state / f'ocdbt.process_{process}'}"}
    ).result()
    written: dict[str, set[str]] = {}
    for key in own.list().result():
        name, _, chunk = key.decode().rpartition("/")
        if chunk.startswith("."):
            continue  # .zarray, the array's metadata.
        zarray = json.loads(root.read(f"{name}/.zarray".encode()).result().value)
        region = tuple(
            (int(i) * size, min((int(i) + 1) * size, length))
            for i, size, length in zip(chunk.split("."), zarray["chunks"], zarray["shape"], strict=True)
        )
        written.setdefault(name, set()).add(regions.key(region))
    return written


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["split", "replicas"], ids=["1x4", "2x2"])
def test_each_process_s_files_hold_only_its_shards_and_their_checksums(job, layout):
    seen, output = job
    step = output / layout / "0"
    saved_as = {"split": "saved_1x4", "replicas": "saved_2x2"}[layout]
    for process in range(2):
        written, summed = _written_regions(step, process), _checksum_regions(step, process)
        # Its checksums are of exactly the bytes its own database holds ...
        assert written == summed, (process, written, summed)
        # ... each within a shard on its own devices.
        held = {
            name: [regions.from_key(key) for key in keys] for name, keys in seen[process][saved_as].items()
        }
        for name, keys in summed.items():
            for key in keys:
                region = regions.from_key(key)
                assert any(regions.intersection(region, shard) == region for shard in held[name]), (name, key)
    # Every element once: 1x4, each process its own half; 2x2, each replica half of each shard.
    for name, (shape, _) in _worker_module().SHAPES.items():
        parts = [
            regions.from_key(key) for process in range(2) for key in _checksum_regions(step, process)[name]
        ]
        assert sum(regions.num_elements(part) for part in parts) == np.prod(shape), (name, parts)
        assert regions.covered(regions.whole(shape), parts), (name, parts)
    if layout == "split":
        assert _checksum_regions(step, 1)["w"] == {"32:48,0:36", "48:64,0:36"}
    else:  # Orbax's replica-parallel save: replica 1's process writes, and sums, half of each shard.
        assert _checksum_regions(step, 1)["w"] == {"16:32,0:36", "48:64,0:36"}


@pytest.mark.slow
def test_a_checkpoint_split_over_processes_restores_onto_other_layouts_of_the_job(job):
    seen, _ = job
    for process in seen:
        for layout, restored in process["restored"].items():
            assert restored["equal"] == {"w": True, "m": True, "v": True}, (layout, restored)
    # Restored split by columns over all four devices: each saved region of rows is split.
    assert [process["restored"]["columns"]["regions"]["w"] for process in seen] == [
        ["0:64,0:9", "0:64,9:18"],
        ["0:64,18:27", "0:64,27:36"],
    ]


@pytest.mark.slow
@pytest.mark.parametrize("onto", ["one device", "sharded 1x4", "sharded 2x2", "mirrored 4"])
def test_a_checkpoint_split_over_processes_restores_in_one_process(job, onto):
    _, output = job
    strategy = {
        "one device": lambda: jaxstrategy.OneDeviceStrategy("/cpu:1"),
        "sharded 1x4": lambda: jaxstrategy.ShardedStrategy(min_shard_bytes=64),
        "sharded 2x2": lambda: jaxstrategy.ShardedStrategy(num_replicas=2, min_shard_bytes=64),
        "mirrored 4": lambda: jaxstrategy.MirroredStrategy(),
    }[onto]()
    expected = _worker_module().values()
    restored = checkpoint.restore(output / "split", strategy=strategy)
    assert restored.keys() == expected.keys()
    for name, value in expected.items():
        leaf = restored[name]
        assert leaf.dtype == value.dtype and np.array_equal(np.asarray(leaf), value), name
        assert leaf.sharding.device_set <= set(strategy.devices), name
    if onto == "sharded 1x4":
        assert len({str(shard.index) for shard in restored["w"].addressable_shards}) == 4


@pytest.mark.slow
def test_damage_in_process_1_s_part_is_caught_wherever_the_region_restores(job):
    seen, output = job
    where = re.escape(str(output / "damaged"))
    alone, both = (
        rf"{_W_DAMAGED} \(found by process 1\)",
        rf"{_W_DAMAGED} \(found by process 0\)\n{_W_DAMAGED} \(found by process 1\)",
    )
    split = rf"{_W_DAMAGED} \(split over processes 0, 1\)"
    for process in seen:
        for layout, lines in {"1x4": alone, "2x2": both, "replicated": both, "columns": split}.items():
            message = process["damaged"][layout]
            assert message is not None and message.startswith("CorruptCheckpointError: "), (layout, message)
            assert re.search(_DAMAGED.format(where=where, lines=lines), message), (layout, message)
    for strategy in (
        jaxstrategy.OneDeviceStrategy("/cpu:2"),
        jaxstrategy.ShardedStrategy(min_shard_bytes=64),
    ):
        with pytest.raises(
            checkpoint.CorruptCheckpointError, match=_DAMAGED.format(where=where, lines=_W_DAMAGED)
        ):
            checkpoint.restore(output / "damaged", strategy=strategy)


@pytest.mark.slow
def test_iterator_positions_of_two_processes_do_not_restore_in_one(job):
    seen, output = job
    assert seen[0]["iterator_state"] != seen[1]["iterator_state"]  # Each process its own position.
    strategy = jaxstrategy.MirroredStrategy()
    dataset = strategy.distribute_datasets_from_function(lambda context: [np.zeros(2, np.float32)] * 8)
    target = {"w": np.zeros(3, np.float32), "data": iter(dataset)}
    before = target["data"].get_state()
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=rf"(?s)iterator positions of the checkpoint at step 0 in {re.escape(str(output / 'iterators'))}: "
        r".*saved by a job of 2 processes, and this job has 1.*Restore them in a job of 2 processes.*"
        r"restore without a target",
    ):
        checkpoint.restore(output / "iterators", strategy=strategy, target=target)
    assert target["data"].get_state() == before  # Left where it was.
    with pytest.warns(UserWarning, match=r"iterator positions .* are not restored: .* hold None"):
        restored = checkpoint.restore(output / "iterators", strategy=strategy)
    assert restored["data"] is None and restored["w"].shape == (3,)


@pytest.mark.slow
def test_each_process_reads_only_the_part_it_restores(job):
    # rchar of /proc/self/io (Linux): 32 MiB of random floats saved 1x4. Restored 1x4 each process
    # reads its half; restored replicated, all of it. Measured: 15.5 MB and 31.0 MB of 31.0 MB stored.
    seen, _ = job
    for process in seen:
        stored, read = process["big_stored_bytes"], process["bytes_read"]
        assert 0.45 * stored < read["1x4"] < 0.55 * stored, (stored, read)
        assert 0.95 * stored < read["replicated"] < 1.05 * stored, (stored, read)
