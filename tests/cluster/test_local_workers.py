"""run_local_workers: one program as the processes of a job on this machine, never left running."""

from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest

from jaxstrategy._src.cluster import ports
from jaxstrategy._src.cluster.local_workers import LocalWorkers, worker_environment
from jaxstrategy.testing import run_local_workers

PRINT_TASK = "import json, os; c = json.loads(os.environ['TF_CONFIG']); print(c['task']['index'], len(c['cluster']['worker']))"


@pytest.mark.slow  # Three processes.
def test_each_worker_gets_its_task_in_one_cluster():
    results = run_local_workers(["-c", PRINT_TASK], num_workers=3, timeout=60)
    assert [result.stdout for result in results] == ["0 3\n", "1 3\n", "2 3\n"]
    assert all(result.returncode == 0 for result in results)


PRINT_ADDRESSES = (
    "import json, os, time; print(*json.loads(os.environ['TF_CONFIG'])['cluster']['worker']); time.sleep(0.5)"
)


@pytest.mark.slow  # Two jobs of two processes.
def test_two_jobs_started_at_once_get_distinct_ports_each_free_again_once_its_job_ended():
    # Before, the ports' locks were held until the test process exited (and outside the test
    # suite, ports were only free when chosen: two jobs could be handed the same one).
    start, results = threading.Barrier(2), {}

    def job(name):
        start.wait(timeout=30)
        results[name] = run_local_workers(["-c", PRINT_ADDRESSES], timeout=60)

    threads = [threading.Thread(target=job, args=(name,), daemon=True) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert sorted(results) == ["a", "b"], "a job did not end"
    used = {
        name: {int(address.rpartition(":")[2]) for address in result[0].stdout.split()}
        for name, result in results.items()
    }
    assert len(used["a"]) == len(used["b"]) == 2 and not used["a"] & used["b"], used
    for port in used["a"] | used["b"]:  # Each can be locked again, as another job would.
        descriptor = os.open(ports._LOCK_DIRECTORY / str(port), os.O_RDONLY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(descriptor)


def test_the_environment_forces_cpu_devices_and_keeps_other_xla_flags():
    config = {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    env = worker_environment(
        config,
        3,
        {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8", "PATH": "/bin"},
    )
    assert env["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"
    assert json.loads(env["TF_CONFIG"]) == config
    assert (env["JAX_PLATFORMS"], env["PATH"]) == ("cpu", "/bin")


@pytest.mark.slow  # Two processes, and a 2 s timeout.
def test_workers_past_the_timeout_are_killed_and_their_output_shown():
    program = "import time; print('started', flush=True); time.sleep(600)"
    workers = LocalWorkers(["-c", program], 2, devices_per_worker=1, env=None, cwd=None)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"The 2 local workers did not all end within 2 s") as err:
        workers.wait(timeout=2)
    assert "--- worker 1: exit status -9\n--- stdout (end):\nstarted" in str(err.value)
    assert time.monotonic() - started < 30
    assert all(process.poll() is not None for process in workers.processes)


def test_the_number_of_workers_is_checked():
    with pytest.raises(ValueError, match=r"run_local_workers\(num_workers=0\): expected an int >= 1"):
        run_local_workers(["-c", "pass"], num_workers=0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (
            {"args": "train.py"},
            TypeError,
            r"run_local_workers\(args='train.py'\): expected a list of strings",
        ),
        ({"args": ["-c", 1]}, TypeError, r"expected a list of strings"),
        (
            {"devices_per_worker": 0},
            ValueError,
            r"run_local_workers\(devices_per_worker=0\): expected an int >= 1",
        ),
        ({"timeout": 0}, ValueError, r"run_local_workers\(timeout=0\): expected a number of seconds > 0"),
    ],
)
def test_bad_arguments_are_refused_before_any_worker_starts(kwargs, error, message):
    with pytest.raises(error, match=message):
        run_local_workers(**{"args": ["-c", "pass"], **kwargs})
