"""The example scripts run to the end and print the spec's results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Each test runs the example as a process of its own.

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_TOUR = REPO_ROOT / "examples" / "spec_tour.py"
TIMEOUT_S = 120


def run_spec_tour(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SPEC_TOUR), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_spec_tour_prints_the_spec_results() -> None:
    completed = run_spec_tour()
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    expected = [
        "extended.worker_devices: ('/job:localhost/replica:0/task:0/device:CPU:0',)",
        "v.device as TensorFlow names it: /job:localhost/replica:0/task:0/device:CPU:0",
        # The step_fn loop.
        "result: 90",
        # reduce(SUM, range(10)) with axis=None, then axis=0.
        "axis=None: [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]",
        "axis=0: 45",
        # gather on one replica returns its input: the same shape for every axis.
        "axis=0: shape (2, 1), value [[1], [2]]",
        "axis=0: shape (1, 2, 3), dtype int32, value [[[0, 1, 2], [3, 4, 5]]]",
        "axis=1: shape (1, 2, 3), dtype int32, value [[[0, 1, 2], [3, 4, 5]]]",
        "axis=2: shape (1, 2, 3), dtype int32, value [[[0, 1, 2], [3, 4, 5]]]",
        # The value_fn examples: 1-tuples with one replica.
        "local_result: (3.0,)",
        "local_result: (1,)",
        "cluster_resolver: None",
        "num_replicas_in_sync: 1",
        "replica_id_in_sync_group: 0 (int32)",
        "all_reduce SUM: [0, 1, 2] (int32)",
        # The dataset examples.
        "[0, 1] on cpu:0, committed=True",
        "[8, 9] on cpu:0, committed=True",
        "dataset_fn called with InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1)",
        "replica_results: (4.0,)",
    ]
    missing = [line for line in expected if line not in lines]
    assert not missing, f"missing lines: {missing}\n--- stdout ---\n{completed.stdout}"


def test_spec_tour_rejects_a_missing_device_with_a_clear_message() -> None:
    completed = run_spec_tour("--device", "/cpu:99")
    assert completed.returncode != 0
    assert "no such device" in completed.stderr
    assert "'/cpu:99'" in completed.stderr
    assert "Traceback" not in completed.stderr
