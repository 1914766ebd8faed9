"""MultiWorkerMirroredStrategy: as a job of this process alone, and as two processes on 127.0.0.1.

The two-process tests start real jobs through `jaxstrategy.testing.run_local_workers` (two CPU
devices per process, four replicas), each with a hard timeout: the conformance suite run by
pytest in both processes, the scenarios of multi_worker_scenarios.py, the nnx + optax example
against one device, a process killed mid-run, a coordinator nobody can reach, and SIGTERM
without a PreemptionHandler.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from conformance import (
    StrategyConformance,
    assert_conformance_passes_in_two_processes,
    shared_tmp_path,  # noqa: F401  (tmp_path, one directory for a job's processes)
)

import jaxstrategy
from jaxstrategy import MultiWorkerMirroredStrategy, SimpleClusterResolver, checkpoint
from jaxstrategy._src.cluster import joining, ports
from jaxstrategy._src.cluster.local_workers import LocalWorkers, describe_results, worker_environment
from jaxstrategy._src.core.device_spec import require_same_devices_per_process
from jaxstrategy.testing import assert_tree_on_strategy, run_local_workers

REPO_ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = REPO_ROOT / "tests" / "multi_worker_scenarios.py"
EXAMPLE = REPO_ROOT / "examples" / "multi_worker.py"
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def multi_worker_strategy():
    """This process alone; in the workers of test_conformance_passes_in_each_of_two_processes,
    their two-process job."""
    return MultiWorkerMirroredStrategy()


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, multi_worker_strategy):
        return multi_worker_strategy


def require_success(results: list[subprocess.CompletedProcess[str]]) -> None:
    if any(result.returncode != 0 for result in results):
        pytest.fail(f"a worker failed:\n{describe_results(results)}")


# --- this process alone --------------------------------------------------------------------


def test_without_a_cluster_it_is_this_process_alone(multi_worker_strategy, cpu_devices):
    strategy = multi_worker_strategy
    resolver = strategy.cluster_resolver
    assert (resolver.num_processes, resolver.process_id, resolver.coordinator_address) == (1, 0, None)
    assert (resolver.task_type, resolver.task_id) == (None, None)  # As TensorFlow without TF_CONFIG.
    assert strategy.devices == tuple(cpu_devices) and strategy.num_replicas_in_sync == 4
    extended = strategy.extended
    assert extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)
    )
    assert (extended.should_checkpoint, extended.should_save_summary) == (True, True)
    assert extended.experimental_between_graph is False
    assert repr(strategy) == f"MultiWorkerMirroredStrategy(cluster_resolver={resolver!r})"
    assert strategy == MultiWorkerMirroredStrategy() and hash(strategy) == hash(MultiWorkerMirroredStrategy())
    assert strategy != jaxstrategy.MirroredStrategy()


def test_an_evaluator_task_is_a_job_of_one(monkeypatch):
    tf_config = {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, "task": {"type": "evaluator"}}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    strategy = MultiWorkerMirroredStrategy()
    assert strategy.cluster_resolver.task_type == "evaluator"
    assert strategy.cluster_resolver.num_processes == 1 and strategy.num_replicas_in_sync == 4
    assert strategy.extended.worker_devices[0] == "/job:evaluator/replica:0/task:0/device:CPU:0"
    assert (strategy.extended.should_checkpoint, strategy.extended.should_save_summary) == (False, False)


def test_a_job_of_several_processes_cannot_start_once_jax_has(cpu_devices):
    # (cpu_devices: JAX has started, whatever ran before this test.)
    resolver = SimpleClusterResolver("127.0.0.1:1", num_processes=2, process_id=1)
    with pytest.raises(
        RuntimeError,
        match=r"cannot join process 1 of 2, coordinator 127.0.0.1:1: JAX has already started in this "
        r"process .* Create the strategy first thing in the program",
    ):
        MultiWorkerMirroredStrategy(resolver)
    assert not jax.distributed.is_initialized()


def test_a_job_jax_detects_is_never_left_for_one_process(monkeypatch, cpu_devices):
    # What SLURM sets for a task of a two-task job; JAX's own detection finds it.
    for name, value in {
        "SLURM_JOB_ID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "node1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(
        RuntimeError, match=r"cannot join the SlurmCluster job JAX detected: JAX has already started"
    ):
        MultiWorkerMirroredStrategy()


def test_a_kubernetes_pod_without_its_client_library_trains_alone_without_a_warning(monkeypatch):
    # JAX's Kubernetes check warns, then detects nothing, as jax.distributed.initialize() would.
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert MultiWorkerMirroredStrategy().cluster_resolver.num_processes == 1


def test_a_malformed_tf_config_is_an_error(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["127.0.0.1:1"]}')
    with pytest.raises(ValueError, match=r"TF_CONFIG is not valid JSON"):
        MultiWorkerMirroredStrategy()


def test_a_resolver_of_the_wrong_type_is_an_error():
    with pytest.raises(
        TypeError,
        match=r"MultiWorkerMirroredStrategy\(cluster_resolver=.127.0.0.1:1.\): expected a jaxstrategy",
    ):
        MultiWorkerMirroredStrategy("127.0.0.1:1")


@pytest.mark.parametrize(
    "name", ["initialization_timeout", "heartbeat_timeout_seconds", "input_timeout_seconds"]
)
@pytest.mark.parametrize(
    ("value", "error", "expected"),
    [(0, ValueError, "1 second or more"), (2.5, TypeError, "an int of seconds"), (True, TypeError, "an int")],
)
def test_timeouts_are_whole_seconds(name, value, error, expected):
    with pytest.raises(error, match=rf"MultiWorkerMirroredStrategy\({name}={value!r}\): expected {expected}"):
        MultiWorkerMirroredStrategy(**{name: value})


def test_counting_accelerators_before_joining_is_an_error():
    resolver = SimpleClusterResolver("127.0.0.1:1", num_processes=2, process_id=0)
    with pytest.raises(RuntimeError, match=r"num_accelerators\(\): this is process 0 of 2, and JAX's"):
        resolver.num_accelerators()


class Incomplete(jaxstrategy.ClusterResolver):
    def __init__(self, **facts):
        self.__dict__.update(facts)


@pytest.mark.parametrize(
    ("facts", "error", "message"),
    [
        (
            {"num_processes": 1, "process_id": 0},
            TypeError,
            r"Incomplete has no attribute 'coordinator_address'",
        ),
        (
            {"coordinator_address": None, "num_processes": "2", "process_id": 0},
            TypeError,
            r"Incomplete\(num_processes='2'\): expected an int",
        ),
        (
            {"coordinator_address": "h", "num_processes": 2, "process_id": 1},
            ValueError,
            r"Incomplete\(coordinator_address='h'\): it has no port",
        ),
    ],
)
def test_a_resolver_of_ones_own_is_checked_before_joining(facts, error, message):
    with pytest.raises(error, match=rf"MultiWorkerMirroredStrategy\(\): {message}"):
        MultiWorkerMirroredStrategy(Incomplete(**facts))


def test_a_mesh_without_this_process_s_devices_is_an_error(monkeypatch, cpu_devices):
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # As if every device were another process's.
    with pytest.raises(
        jaxstrategy.InvalidDeviceError,
        match=r"(?s)MirroredStrategy\(\): this process \(process 1\) must hold.*replicas.*Order the devices",
    ):
        jaxstrategy.MirroredStrategy()


def fake_devices(counts: list[int]) -> list[types.SimpleNamespace]:
    """What `jax.devices()` lists for processes with these device counts, process by process."""
    devices, next_id = [], 0
    for process, count in enumerate(counts):
        for _ in range(count):
            devices.append(types.SimpleNamespace(process_index=process, id=next_id))
            next_id += 1
    return devices


@pytest.mark.parametrize("counts", [[1], [2, 2], [8, 8, 8]], ids=["one", "two", "three"])
def test_processes_with_the_same_number_of_devices_are_a_job(counts):
    require_same_devices_per_process(fake_devices(counts), "MultiWorkerMirroredStrategy()")


@pytest.mark.parametrize(
    ("counts", "listed"),
    [
        ([2, 1], "  2 devices: process 0\n  1 device: process 1\n"),
        ([8, 7, 8, 8, 6], "  8 devices: processes 0, 2, 3\n  7 devices: process 1\n  6 devices: process 4\n"),
    ],
    ids=["2-1", "8-7-8-8-6"],
)
def test_processes_with_different_numbers_of_devices_are_an_error_naming_each(counts, listed):
    # Before, JAX's own check of the first `put` failed with "cannot reshape array of size 3
    # into shape (2,2)", and a distributed dataset with shapes that differed by process.
    with pytest.raises(jaxstrategy.InvalidDeviceError) as raised:
        require_same_devices_per_process(fake_devices(counts), "MultiWorkerMirroredStrategy()")
    assert str(raised.value) == (
        "MultiWorkerMirroredStrategy(): the processes of this job have different numbers of devices:\n"
        + listed
        + "Every process must have the same number, one replica per device: each process feeds and "
        "reads its own replicas, and JAX's arrays over several processes need as many on each. "
        "Start every process with the same devices (on GPUs, as many in CUDA_VISIBLE_DEVICES; on "
        "CPUs, the same --xla_force_host_platform_device_count in XLA_FLAGS)."
    )


# --- two processes -------------------------------------------------------------------------
# Every test below starts processes, so each is marked slow (`make test-fast` skips them).


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory) -> tuple[list[dict], Path]:
    """Runs multi_worker_scenarios.py as a job of two processes; what each saw, and its folder."""
    output = tmp_path_factory.mktemp("scenarios")
    results = run_local_workers([str(SCENARIOS), str(output)], devices_per_worker=2, timeout=TIMEOUT_S)
    require_success(results)
    return [json.loads((output / f"process-{i}.json").read_text()) for i in range(2)], output


@pytest.mark.slow
def test_the_spec_tf_config_example_takes_the_worker_branch(scenarios):
    seen, _ = scenarios
    for index, process in enumerate(seen):
        assert process["branch"] == "worker"
        assert process["task"] == ["worker", index, index, 2]
        assert process["cluster_jobs"] == ["ps", "worker"]
        assert process["num_replicas_in_sync"] == 4
        assert process["worker_devices"] == [
            f"/job:worker/replica:0/task:{index}/device:CPU:{i}" for i in (0, 1)
        ]
        assert process["chief"] == [index == 0, index == 0]  # Checkpoints and summaries: the chief.
        assert process["between_graph"] is True
        assert process["num_accelerators"] == {}


@pytest.mark.slow
def test_a_second_strategy_joins_the_running_job(scenarios):
    seen, _ = scenarios
    for index, process in enumerate(seen):
        assert process["rejoining"]["second_strategy_equal"] is True
        assert re.search(
            rf"already runs in this process as process {index} of 2, but the cluster resolver makes it "
            rf"process {1 - index} of 2",
            process["rejoining"]["mismatch"],
        )


@pytest.mark.slow
def test_local_results_are_this_process_and_combined_results_the_same_everywhere(scenarios):
    seen, _ = scenarios
    for index, process in enumerate(seen):
        collectives = process["collectives"]
        mine = [2 * index, 2 * index + 1]
        assert collectives["local_ids"] == [[float(i)] for i in mine]
        assert collectives["run_local_ids"] == mine
        assert collectives["reduce_sum"] == [6.0] and collectives["reduce_mean"] == [1.5]
        assert collectives["gather"] == collectives["all_gather_in_run"] == [0.0, 1.0, 2.0, 3.0]
        assert collectives["all_reduce_in_run"] == 4
        assert collectives["put"] == [0.0, 1.0, 2.0]


@pytest.mark.slow
def test_each_process_keeps_its_replicas_parts_of_the_same_global_batches(scenarios):
    seen, _ = scenarios
    for index, process in enumerate(seen):
        batches = [np.arange(8 * i, 8 * i + 8).reshape(4, 2) for i in range(3)]
        assert process["split_batches"]["local_parts"] == [
            b[2 * index : 2 * index + 2].tolist() for b in batches
        ]
        assert process["split_batches"]["sums"] == [int(b.sum()) for b in batches]
        assert process["split_batches"]["len"] == 3


@pytest.mark.slow
def test_unequal_inputs_end_every_process_at_the_same_step_with_a_warning(scenarios):
    seen, _ = scenarios
    for process in seen:
        assert process["unequal_inputs"]["steps"] == 3
    (short,) = [w for w in seen[0]["unequal_inputs"]["warnings"] if "ended at step" in w]
    (long,) = [w for w in seen[1]["unequal_inputs"]["warnings"] if "ended at step" in w]
    prefix = r"distribute_datasets_from_function\(\): the input of 1 of 2 processes ended at step 3 "
    assert re.match(f"MultiWorkerMirroredStrategy.{prefix}", short)
    assert "this process's input is one of those that ended" in short
    assert "this process leaves 2 batch(es) unread" in long


@pytest.mark.slow
def test_per_replica_pipelines_feed_this_process_s_replicas(scenarios):
    seen, _ = scenarios
    for index, process in enumerate(seen):
        mine = [2 * index, 2 * index + 1]
        assert process["per_replica_inputs"]["contexts"] == [[4, i] for i in mine]
        assert process["per_replica_inputs"]["parts"] == [[[i, i] for i in mine]] * 2


@pytest.mark.slow
def test_python_numbers_across_processes_are_strongly_typed(scenarios):
    seen, _ = scenarios
    assert [process["python_numbers"] for process in seen] == [{"dtype": "float32", "weak_type": False}] * 2


@pytest.mark.slow
def test_datasets_made_in_different_orders_time_out_with_a_clear_error(scenarios):
    seen, _ = scenarios
    for index, process in enumerate(seen):
        assert re.match(
            rf"MultiWorkerMirroredStrategy.experimental_distribute_dataset\(\): process {index} waited 3 s "
            r"for the other processes to reach step 0 of this dataset's pass, and only 1 of 2 did\. "
            r"Every process must create and iterate the same distributed datasets in the same order",
            process["mismatched_datasets"]["error"],
        )


@pytest.mark.slow
def test_parts_that_differ_between_processes_are_an_error_on_every_process(scenarios):
    # Before, gather returned memory nobody wrote ([545193985, 0, 1, 1]) and gloo then aborted.
    seen, _ = scenarios
    for process in seen:
        errors = process["shapes_that_differ"]["errors"]
        assert errors["values"] == (
            "MultiWorkerMirroredStrategy.experimental_distribute_values_from_function(): value_fn's "
            "results differ between processes in structure, shape or dtype, so they cannot make one "
            "value over every replica (one program runs on all of them):\n"
            "  process 0: PyTreeDef(*): float32[1]\n  process 1: PyTreeDef(*): float32[2]\n"
            "Make every process's results the same shape and dtype."
        )
        assert errors["dataset"].startswith(
            "MultiWorkerMirroredStrategy.distribute_datasets_from_function(): at step 1 of this pass, "
            "the processes' batches differ in structure, shape or dtype, so they cannot make one "
            "global batch (one program runs on every replica):\n"
            "  process 0: PyTreeDef(*): float32[2, 2, 2]\n  process 1: PyTreeDef(*): float32[2, 1, 2]\n"
        )
        assert process["shapes_that_differ"]["steps_before"] == 1  # The first step fit.


@pytest.mark.slow
def test_reduce_and_gather_work_under_an_outer_jit_across_processes(scenarios):
    seen, _ = scenarios
    for process in seen:
        result = process["under_jit"]
        # Replica r holds [2r, 2r] after the step.
        assert result["sum"] == [12.0, 12.0]
        assert result["mean"] == 3.0
        assert result["gathered"] == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0]
        assert result["local_results_error"].startswith(
            "MultiWorkerMirroredStrategy.experimental_local_results(): called under jax.jit"
        )
        assert "call experimental_local_results outside it" in result["local_results_error"]
        # docs/semantics.md: JAX refuses a closed-over PerReplica (its array spans the processes);
        # passed as an argument, above, it works. A replicated array may be closed over.
        assert result["closure_error"].startswith(
            "Closing over jax.Array that spans non-addressable (non process local) devices is not "
            "allowed. Please pass such arrays as arguments to the function."
        )
        assert result["closing_over_replicated"] == [2.0, 2.0]


@pytest.mark.slow
def test_a_checkpoint_saved_by_two_processes_restores_in_one(scenarios, cpu_devices):
    seen, output = scenarios
    per_replica = [[float(i)] * 2 for i in range(4)]
    assert [process["checkpoint"]["restored_here"] for process in seen] == [per_replica, per_replica]
    for strategy in (jaxstrategy.OneDeviceStrategy("/cpu:1"), jaxstrategy.MirroredStrategy(cpu_devices[:2])):
        restored = checkpoint.restore(output / "checkpoint", strategy=strategy)
        assert np.asarray(restored["w"]).tolist() == np.arange(6.0).reshape(2, 3).tolist()
        assert np.asarray(restored["per_replica"]).tolist() == per_replica
        assert_tree_on_strategy(restored, strategy)


@pytest.mark.slow
def test_conformance_passes_in_each_of_two_processes(tmp_path):
    assert_conformance_passes_in_two_processes(__file__, tmp_path, timeout=TIMEOUT_S)


@pytest.mark.slow
def test_nnx_optax_training_matches_one_device(tmp_path):
    steps = ["--steps", "8"]
    results = run_local_workers(
        [str(EXAMPLE), *steps, "--checkpoint-dir", str(tmp_path)], devices_per_worker=2, timeout=TIMEOUT_S
    )
    require_success(results)
    one_device = subprocess.run(
        [sys.executable, str(EXAMPLE), *steps, "--strategy", "one-device"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        check=True,
    )

    def losses(text: str) -> list[float]:
        return [float(loss) for loss in re.findall(r"^step \d+: loss (\S+)$", text, re.MULTILINE)]

    assert "4 replicas" in results[0].stdout
    assert losses(results[1].stdout) == []  # Only the chief logs.
    np.testing.assert_allclose(losses(results[0].stdout), losses(one_device.stdout), rtol=1e-5)
    assert len(losses(one_device.stdout)) == 8
    assert checkpoint.restore(tmp_path, strategy=jaxstrategy.OneDeviceStrategy())["model"]


KILLED_PROGRAM = """
import os, signal, jax.numpy as jnp, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=3)
total = lambda x: jaxstrategy.get_replica_context().all_reduce('sum', x)
for step in range(100_000):
    if step == 5 and strategy.cluster_resolver.task_id == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    print(step, float(strategy.run(total, args=(1.0,))), flush=True)
"""


# Process 0 with two devices, process 1 with one: the device count set before JAX starts.
UNEVEN_PROGRAM = """
import json, os
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={2 - index}"
import jaxstrategy
try:
    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    print("no error:", strategy.num_replicas_in_sync, "replicas")
except jaxstrategy.InvalidDeviceError as error:
    print(error)
"""


@pytest.mark.slow
def test_processes_with_different_numbers_of_devices_are_told_so_on_every_process():
    results = run_local_workers(["-c", UNEVEN_PROGRAM], devices_per_worker=2, timeout=120)
    require_success(results)
    for result in results:
        assert result.stdout.startswith(
            "MultiWorkerMirroredStrategy(): the processes of this job have different numbers of "
            "devices:\n  2 devices: process 0\n  1 device: process 1\n"
        ), describe_results(results)


@pytest.mark.slow
def test_the_survivor_of_a_killed_process_exits_with_an_error_in_bounded_time():
    started = time.monotonic()
    workers = LocalWorkers(["-c", KILLED_PROGRAM], 2, devices_per_worker=1, env=None, cwd=None)
    survivor, killed = workers.wait(timeout=120)
    elapsed = time.monotonic() - started
    assert killed.returncode == -9, describe_results([survivor, killed])
    assert survivor.returncode != 0, describe_results([survivor, killed])
    assert "4 2.0" in survivor.stdout  # It ran steps with the other process first.
    assert re.search(r"another task died|Connection reset by peer", survivor.stderr), survivor.stderr[-2000:]
    assert elapsed < 60


@pytest.mark.slow
def test_an_unreachable_coordinator_is_reported_before_the_process_ends():
    # Task 1 of a job whose task 0 (the coordinator) never starts, at ports no other job can take.
    with ports.reserve_ports(2) as reserved:
        addresses = [f"127.0.0.1:{port}" for port in reserved.ports]
        tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": 1}}
        program = "import jaxstrategy; jaxstrategy.MultiWorkerMirroredStrategy(initialization_timeout=2, heartbeat_timeout_seconds=2)"
        started = time.monotonic()
        completed = subprocess.run(
            [sys.executable, "-c", program],
            env=worker_environment(tf_config, 1, None),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        assert completed.returncode != 0
        assert (
            f"MultiWorkerMirroredStrategy() could not join process 1 of 2, coordinator {addresses[0]} within "
            "initialization_timeout=2 s: the coordinator could not be reached"
        ) in completed.stderr, completed.stderr[-2000:]
        assert time.monotonic() - started < 60


@pytest.mark.slow
def test_a_coordinator_port_in_use_is_a_clear_error_not_a_crash():
    # JAX's coordination service crashes the process (SIGSEGV) when its port is taken.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        tf_config = {
            "cluster": {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]},
            "task": {"type": "worker", "index": 0},
        }
        completed = subprocess.run(
            [sys.executable, "-c", "import jaxstrategy; jaxstrategy.MultiWorkerMirroredStrategy()"],
            env=worker_environment(tf_config, 1, None),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    assert completed.returncode == 1, completed.stderr[-2000:]
    assert (
        f"RuntimeError: MultiWorkerMirroredStrategy(): this is process 0, which serves the job's coordinator at "
        f"127.0.0.1:{port}, but port {port} is already in use on this host."
    ) in completed.stderr


ENDING_EARLY_PROGRAM = """
import sys, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=3)
total = lambda x: jaxstrategy.get_replica_context().all_reduce('sum', x)
for step in range(100_000):
    if step == {step} and strategy.cluster_resolver.task_id == 1:
        {ending}
    print(step, float(strategy.run(total, args=(1.0,))), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "step, ending, told",
    [
        (5, "raise RuntimeError('boom')", "process 1 of 2 failed with RuntimeError: boom"),
        (5, "sys.exit(3)", "process 1 of 2 left the job: its program ended while process(es) 0 went on"),
        (0, "sys.exit(0)", "process 1 of 2 left the job: its program ended while process(es) 0 went on"),
    ],
    ids=["raises mid-loop", "exits mid-loop", "exits before the first step"],
)
def test_a_process_ending_early_ends_the_job_in_bounded_time_naming_it(step, ending, told):
    # Before, each of these hung until killed: process 1 waited for process 0 at JAX's shutdown,
    # process 0 for process 1 in a step (or gloo gave up after 30 s with DEADLINE_EXCEEDED).
    program = ENDING_EARLY_PROGRAM.format(step=step, ending=ending)
    started = time.monotonic()
    workers = LocalWorkers(["-c", program], 2, devices_per_worker=1, env=None, cwd=None)
    survivor, ended = workers.wait(timeout=120)
    elapsed = time.monotonic() - started
    described = describe_results([survivor, ended])
    assert survivor.returncode == 1 and ended.returncode != 0, described
    assert told in survivor.stderr, described
    if step:
        assert f"{step - 1} 2.0" in survivor.stdout, described  # It ran steps with the other first.
    assert "Check failure stack trace" not in survivor.stderr + ended.stderr, described
    assert elapsed < 45, described


WAITING_INPUT_THREAD_PROGRAM = """
import jax, numpy as np, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy()
# Process 0 places batches as it takes them; process 1's input thread runs ahead, into the next
# step's agreement, where it waits for process 0, which never comes: the program ends first.
buffer_size = 0 if jax.process_index() == 0 else 2
options = jaxstrategy.InputOptions(experimental_per_replica_buffer_size=buffer_size)
dataset = strategy.distribute_datasets_from_function(lambda context: [np.ones(2, np.float32)] * 8, options)
iterator = iter(dataset)
print(strategy.reduce("sum", next(iterator), axis=None).tolist(), flush=True)
"""


@pytest.mark.slow
def test_an_input_thread_waiting_for_other_processes_at_exit_ends_cleanly():
    # Before, the thread was still inside the coordination service's blocking read as Python
    # finalized, and the process aborted ("terminate called ... exception not rethrown").
    results = run_local_workers(["-c", WAITING_INPUT_THREAD_PROGRAM], devices_per_worker=1, timeout=TIMEOUT_S)
    assert [result.returncode for result in results] == [0, 0], describe_results(results)
    assert all("[2.0, 2.0]" in result.stdout for result in results), describe_results(results)


AHEAD_PROGRAM = """
import time, jax, jax.numpy as jnp, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=20)
w = jnp.zeros(())
for step in range(6):
    # Replicated in and out: nothing here makes process 1 wait for the chief, so it ends first.
    w = strategy.reduce("sum", strategy.run(lambda w: w + 1.0, args=(w,)), axis=None)
    if strategy.cluster_resolver.task_id == 0:  # Only the chief reads, and it is slow.
        print(step, float(w), flush=True)
        time.sleep(1)
"""


@pytest.mark.slow
def test_a_process_that_ends_ahead_of_the_others_leaves_the_job_to_finish():
    # With asynchronous dispatch, process 1 reaches its end while its last steps still wait for
    # the chief; the chief must finish them, not take the end for a failure.
    results = run_local_workers(["-c", AHEAD_PROGRAM], devices_per_worker=1, timeout=TIMEOUT_S)
    assert [result.returncode for result in results] == [0, 0], describe_results(results)
    # Each step sums w + 1 over the 2 replicas: 2, 6, 14, 30, 62, 126.
    assert "5 126.0" in results[0].stdout, describe_results(results)


SHUTS_JAX_DOWN_PROGRAM = """
import time, jax, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=5)
total = strategy.run(lambda: jaxstrategy.get_replica_context().all_reduce("sum", 1.0))
print(float(strategy.reduce("sum", total, axis=None)), flush=True)
jax.distributed.shutdown()  # As many programs end: the processes wait for each other here.
time.sleep(1)
"""


@pytest.mark.slow
def test_a_program_that_shuts_jax_down_itself_ends_normally():
    # The end announcements need JAX's client; after jax.distributed.shutdown() there is none,
    # and waiting for announcements that cannot come ended both processes with status 1.
    started = time.monotonic()
    results = run_local_workers(["-c", SHUTS_JAX_DOWN_PROGRAM], devices_per_worker=1, timeout=TIMEOUT_S)
    assert [result.returncode for result in results] == [0, 0], describe_results(results)
    assert all("4.0" in result.stdout for result in results)
    assert time.monotonic() - started < 30  # Not the heartbeat timeout, and no 300 s shutdown wait.


SIGTERM_PROGRAM = """
import json, os, signal, time, jaxstrategy
from jax.experimental import multihost_utils
task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
if task == 1:  # A handler of the program's own.
    signal.signal(signal.SIGTERM, lambda *_: (print("its own handler", flush=True), os._exit(3)))
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=5)
# Both joined before either ends: process 0 runs the coordination service, and a process still
# starting when it ends would fail for that, not for its signal.
multihost_utils.sync_global_devices("joined")
print("joined", flush=True)
if task == 0:
    time.sleep(1)  # Process 1's handler has run by then.
os.kill(os.getpid(), signal.SIGTERM)  # No PreemptionHandler: as without jax.distributed.
time.sleep(5)
print("SIGTERM was swallowed", flush=True)
"""


@pytest.mark.slow
def test_sigterm_does_what_it_did_before_the_strategy_joined_the_job():
    # Before, JAX's preemption notifier (a C++ handler that jax.distributed.initialize installs)
    # caught SIGTERM, logged it and let the process go on, while after a PreemptionHandler had
    # been closed SIGTERM ended it. Now it ends it either way, or runs the program's own handler.
    results = run_local_workers(["-c", SIGTERM_PROGRAM], devices_per_worker=1, timeout=TIMEOUT_S)
    described = describe_results(results)
    assert [result.returncode for result in results] == [-signal.SIGTERM, 3], described
    printed = [[line for line in r.stdout.splitlines() if not line.startswith("[Gloo]")] for r in results]
    assert printed == [["joined"], ["joined", "its own handler"]], described


def test_a_strategy_made_outside_the_main_thread_warns_that_sigterm_stays_with_jax():
    # Only the main thread can set a signal handler: JAX's notifier would swallow SIGTERM.
    with pytest.warns(
        RuntimeWarning,
        match=r"MultiWorkerMirroredStrategy\(\): created outside the main thread, where no signal handler "
        r"can be set, so the SIGTERM handler that jax.distributed.initialize installed stays: .* Create the "
        r"strategy in the main thread",
    ) as warned:
        thread = threading.Thread(
            target=joining.put_back_sigterm, args=(signal.SIG_DFL, "MultiWorkerMirroredStrategy()")
        )
        thread.start()
        thread.join()
    assert len(warned) == 1
    joining.put_back_sigterm(
        signal.SIG_DFL, "MultiWorkerMirroredStrategy()"
    )  # In the main thread: put back, no warning.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
