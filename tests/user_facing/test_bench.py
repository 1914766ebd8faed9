"""The benchmarks run end to end (their --quick smoke mode); their figures are not asserted here.

Each benchmark checks what it can check without timing: run_overhead forces four CPU devices
and fails on any retrace or compile while timed, checkpoint verifies every round trip,
input_pipeline counts compiles while timed, mirrored forces two CPU devices and fails on any
retrace, multi_worker starts jobs of one and of two processes and fails on any retrace, then jobs
of 2 and 4 processes that fail on any call to the coordinator per step for sources with a len(),
nnx fails on any retrace or compile while timed, loss_checks checks that its checks catch a
negative batch size and fails on any compile while timed, sharded forces four CPU devices, fails
on any retrace or compile while timed (in its 2-process job too) and skips its Keras rows without
keras.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Each benchmark is a process of its own.

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script",
    [
        "run_overhead.py",
        "checkpoint.py",
        "input_pipeline.py",
        "mirrored.py",
        "multi_worker.py",
        "nnx.py",
        "loss_checks.py",
        "sharded.py",
    ],
)
def test_benchmark_smoke_run(script):
    _smoke(script)


def test_keras_comparison_smoke_run():
    if importlib.util.find_spec("keras") is None:  # Not imported here: it needs KERAS_BACKEND first.
        pytest.skip("bench/vs_keras.py needs the bench extra: pip install -e '.[bench]'")
    _smoke("vs_keras.py")


def _smoke(script):
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / script), "--quick"],
        cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},  # The machine's real devices.
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "goal" in done.stdout
