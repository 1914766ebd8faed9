"""MultiWorkerShardedStrategy: how a job's devices become replicas, in one process, and a real job
of two processes with two CPU devices each, trained against a plain `jax.jit` loop on one device."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import chex
import jax
import numpy as np
import pytest
from conformance import (
    StrategyConformance,
    assert_conformance_passes_in_two_processes,
    shared_tmp_path,  # noqa: F401  (tmp_path, one directory for a job's processes)
)

import jaxstrategy
from jaxstrategy._src.cluster.local_workers import run_local_workers
from jaxstrategy._src.strategies import job as job_part
from jaxstrategy._src.strategies import multi_worker_sharded
from jaxstrategy._src.strategies.multi_worker_sharded import ordered_by_host, require_whole_processes

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import sharded_job_worker as worker  # noqa: E402
import sharded_nnx_scenario  # noqa: E402

REPO_ROOT = HERE.parents[1]

pytestmark = pytest.mark.filterwarnings("ignore:.*no dimension of it divides:UserWarning")


@pytest.fixture(scope="module")
def sharded_job_strategy():
    """This process alone; in the workers of test_conformance_passes_in_each_of_two_processes,
    their two-process job: one replica (one host) over both, each holding half of its leaves."""
    return jaxstrategy.MultiWorkerShardedStrategy(min_shard_bytes=64)


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, sharded_job_strategy):
        return sharded_job_strategy


def fake_devices(per_process: int, processes: int) -> list[types.SimpleNamespace]:
    """What `jax.devices()` lists, in an order other than the job's: interleaved by process."""
    return [
        types.SimpleNamespace(process_index=p, id=p * per_process + i)
        for i in range(per_process)
        for p in range(processes)
    ]


def test_without_a_cluster_it_is_one_replica_over_this_host(cpu_devices):
    strategy = jaxstrategy.MultiWorkerShardedStrategy()
    assert strategy.num_replicas_in_sync == 1
    assert strategy.devices == tuple(jax.devices())
    assert strategy.cluster_resolver.num_processes == 1
    assert strategy._job.input_pipeline == (1, 0)
    two = jaxstrategy.MultiWorkerShardedStrategy(num_replicas=2, model_parallel=2)
    assert two.mesh.shape == {"replica": 2, "shard": len(jax.devices()) // 4, "model": 2}
    assert "num_replicas=2, model_parallel=2" in repr(two)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"num_replicas": 0},
            ValueError,
            r"num_replicas must be a positive int, or None for one replica per host",
        ),
        (
            {"num_replicas": 3},
            ValueError,
            r"num_replicas=3 does not divide the \d devices.*among \[1, 2, 4[,\]]",
        ),
        ({"model_parallel": 3}, ValueError, r"model_parallel=3 does not divide"),
        ({"initialization_timeout": 0}, ValueError, r"initialization_timeout=0\): expected 1 second or more"),
    ],
)
def test_a_layout_the_job_does_not_fit_is_an_error(kwargs, error, message):
    with pytest.raises(error, match=r"MultiWorkerShardedStrategy\(.*" + message):
        jaxstrategy.MultiWorkerShardedStrategy(**kwargs)


def test_devices_are_ordered_host_by_host_then_process_by_process():
    devices = fake_devices(2, 4)
    hosts = {0: "b", 1: "a", 2: "b", 3: "a"}  # Processes 0 and 2 share host b, listed first.
    ordered = ordered_by_host(devices, hosts)
    assert [(d.process_index, d.id) for d in ordered] == [
        (0, 0), (0, 1), (2, 4), (2, 5), (1, 2), (1, 3), (3, 6), (3, 7),
    ]  # fmt: skip


def test_the_default_is_one_replica_per_host_and_needs_hosts_of_one_size():
    devices = fake_devices(1, 4)
    assert multi_worker_sharded._one_replica_per_host(devices, {0: "a", 1: "a", 2: "b", 3: "b"}) == 2
    with pytest.raises(jaxstrategy.InvalidDeviceError) as raised:
        multi_worker_sharded._one_replica_per_host(devices, {0: "a", 1: "a", 2: "a", 3: "b"})
    assert "different numbers of devices, so one replica per host" in str(raised.value)
    assert "  a: 3 devices\n  b: 1 devices\n" in str(raised.value)
    assert "pass num_replicas= so that every replica is made of whole processes" in str(raised.value)


@pytest.mark.parametrize(
    ("per_process", "processes", "replicas", "fits"),
    [
        (2, 2, 1, True),  # A replica over both processes.
        (2, 2, 4, True),  # Two replicas in each process.
        (4, 3, 6, True),
        (4, 3, 2, False),  # Replicas of 6 devices cut across processes of 4.
        (3, 2, 3, False),  # Replicas of 2 devices cut across processes of 3.
    ],
)
def test_replicas_are_made_of_whole_processes_or_processes_of_whole_replicas(
    monkeypatch, per_process, processes, replicas, fits
):
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    devices = fake_devices(per_process, processes)
    if fits:
        require_whole_processes(devices, replicas)
        return
    with pytest.raises(ValueError, match=r"cut across the processes' \d devices each") as raised:
        require_whole_processes(devices, replicas)
    fitting = [r for r in range(1, len(devices) + 1) if len(devices) % r == 0]
    fitting = [
        r for r in fitting if (len(devices) // r) % per_process == 0 or per_process % (len(devices) // r) == 0
    ]
    assert f"choose num_replicas among {fitting}" in str(raised.value)


@pytest.mark.parametrize(
    ("per_process", "replicas", "expected"),
    [
        (2, 1, [(1, 0), (1, 0)]),  # One replica over both: one pipeline, read by both.
        (2, 2, [(2, 0), (2, 1)]),
        (2, 4, [(2, 0), (2, 1)]),  # Two replicas each: still a pipeline per process.
    ],
)
def test_processes_that_share_a_replica_share_its_input_pipeline(
    monkeypatch, per_process, replicas, expected
):
    devices = sorted(fake_devices(per_process, 2), key=lambda d: d.id)
    for process in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda process=process: process)
        assert job_part.input_pipeline_of_this_process(devices, replicas) == expected[process]


# --- a job of two processes ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[dict]:
    output = tmp_path_factory.mktemp("sharded_job")
    results = run_local_workers(
        [str(HERE / "sharded_job_worker.py"), str(output)], 2, devices_per_worker=2, timeout=240
    )
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((output / f"process-{i}.json").read_text()) for i in (0, 1)]


def _assert_trains_as_one_device(trainings: list[dict]) -> None:
    """Each process's training (`sharded_job_worker.train`'s report) against one device."""
    expected_losses, expected = worker.one_device_training()
    for process, training in enumerate(trainings):
        np.testing.assert_allclose(
            training["losses"], expected_losses, rtol=2e-6, err_msg=f"process {process}"
        )
        for leaf, value in expected.items():
            np.testing.assert_allclose(
                training["params"][leaf], value, atol=1e-6, err_msg=f"{leaf} on {process}"
            )


LAYOUTS = {
    # name: (mesh, which process holds each device of each replica)
    "one_host": ({"replica": 1, "shard": 4}, [[0, 0, 1, 1]]),
    "two_hosts": ({"replica": 2, "shard": 2}, [[0, 0], [1, 1]]),
    "megatron_1": ({"replica": 1, "shard": 2, "model": 2}, [[0, 0, 1, 1]]),
    "megatron_2": ({"replica": 2, "shard": 1, "model": 2}, [[0, 0], [1, 1]]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUTS)
def test_every_layout_of_the_job_trains_as_one_device(job, name):
    # SGD with momentum and clipping by the global norm: a gradient summed rather than averaged
    # over the replicas, or a replica's own, moves the parameters elsewhere.
    mesh, processes = LAYOUTS[name]
    for report in job:
        assert report[name]["mesh"] == mesh
        assert report[name]["replica_devices"] == processes
        assert report[f"{name}_training"]["local_devices"] == 2
    _assert_trains_as_one_device([report[f"{name}_training"] for report in job])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_host", "two_hosts"])
def test_input_pipelines_from_a_function_train_as_one_device(job, name):
    # Where both processes hold parts of one replica, they must read the same rows for it: with a
    # pipeline of its own each, process 1 would feed the replica's devices other examples.
    _assert_trains_as_one_device([report[f"{name}_from_function_training"] for report in job])


@pytest.mark.slow
def test_a_host_holds_a_replica_split_over_its_devices(job):
    # One host (both processes on this machine): one replica over all four devices, each process
    # holding half of each split leaf. As if on two hosts: a replica each, split over its two.
    for process, report in enumerate(job):
        assert report["one_host"]["replica_devices"] == LAYOUTS["one_host"][1]
        assert report["two_hosts"]["replica_devices"] == LAYOUTS["two_hosts"][1]
        whole = 8 * 16 * 4  # w1, float32
        assert report["one_host_training"]["w1_bytes_here"] == whole // 2
        assert report["two_hosts_training"]["w1_bytes_here"] == whole
        assert report["one_host"]["input_pipeline"] == [1, 0]
        assert report["two_hosts"]["input_pipeline"] == [2, process]
        assert report["megatron_1_training"]["specs"]["w1"] == "(None, 'model')"
        # Local results: a leaf this process holds all of comes back on its devices, readable
        # here; one split between the processes, as the replica's array.
        assert report["one_host_training"]["held_here"] == {
            "b1": False,
            "b2": False,
            "w1": False,
            "w2": False,
        }
        assert report["two_hosts_training"]["held_here"] == {"b1": True, "b2": True, "w1": True, "w2": True}
        # One replica over both processes, 'model' within each: the leaves its rules split over
        # 'model' are whole in each process, b2 (by the default, over 'shard') between them.
        megatron = report["megatron_1_training"]
        assert megatron["held_here"] == {"b1": True, "b2": False, "w1": True, "w2": True}
        np.testing.assert_allclose(megatron["local_w1"], megatron["params"]["w1"])


@pytest.mark.slow
def test_processes_of_one_replica_end_their_input_together(job):
    # One replica over both processes holds every replica in each; their inputs must still agree
    # on where they end, as processes holding different replicas do, or one would wait forever.
    for report in job:
        assert report["one_host_uneven_ends"] == {"steps": 2, "warned": True}


@pytest.mark.slow
def test_processes_sharing_a_replica_must_give_it_the_same_values(job):
    # Each process holding a part of the one replica computes its component: were they to
    # differ, its devices would hold different "copies", and reduce differ by process.
    for report in job:
        assert report["diverging_values"] == (
            "MultiWorkerShardedStrategy.experimental_distribute_values_from_function(): value_fn's "
            "results for replica 0 differ between the processes that share it (process 0; process 1 "
            "gave different values), so its devices would hold different copies of one value. Every "
            "process that holds a replica must compute the same result for it: seed random numbers "
            "by the replica id (context.replica_id_in_sync_group), not by the process."
        )


@pytest.mark.slow
def test_an_nnx_model_annotated_with_logical_names_trains_in_place_over_two_processes(job):
    # One replica over both processes, split over 'shard' and 'model' by the kernels' logical
    # names, its nnx.Optimizer updated in place inside `run`.
    expected = sharded_nnx_scenario.reference(worker.batches())
    for report in (r["nnx"] for r in job):
        # Each kernel, and its momentum, laid out as its annotation says: ('embed', 'mlp') is
        # ('shard', 'model'), and the reverse; each process holds half of each (the other half
        # is on the other process's devices).
        assert report["specs"] == {
            "up/kernel": ["('shard', 'model')"] * 2,
            "down/kernel": ["('model', 'shard')"] * 2,
        }
        assert report["held"] == {"up/kernel": [0.5, 0.5], "down/kernel": [0.5, 0.5]}
        # The same training as on one device: sums over split dimensions only add in another
        # order.
        np.testing.assert_allclose(report["losses"], expected["losses"], rtol=1e-5)
        chex.assert_trees_all_close(report["params"], expected["params"], rtol=1e-5, atol=1e-6)
    assert job[0]["nnx"]["params"] == job[1]["nnx"]["params"]


@pytest.mark.slow
def test_a_layout_the_job_does_not_fit_is_an_error_on_every_process(job):
    for report in job:
        assert report["errors"]["three"].startswith(
            "MultiWorkerShardedStrategy(): num_replicas=3 does not divide the 4 devices"
        )
        assert report["errors"]["model"].startswith(
            "MultiWorkerShardedStrategy(): model_parallel=3 does not divide"
        )


@pytest.mark.slow
def test_conformance_passes_in_each_of_two_processes(tmp_path):
    assert_conformance_passes_in_two_processes(__file__, tmp_path, timeout=300)
