"""The demo (`make demo`) trains, reports, checkpoints and plots; run here for one or two short
epochs, and stopped by SIGTERM mid-epoch then resumed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jaxstrategy import checkpoint

pytestmark = pytest.mark.slow  # Each test runs the demo as a process of its own.

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "examples" / "train_digits.py"


def _run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(DEMO), *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_one_short_epoch_prints_and_writes_what_it_says(tmp_path):
    done = _run_demo("--epochs", "1", "--output-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "OneDeviceStrategy(device=CpuDevice(id=0)): 1437 training and 360 test images"
    assert lines[1].startswith("epoch 1: loss ") and ", test accuracy 0." in lines[1]
    assert "; restored from the checkpoint of epoch 1: " in lines[2]
    trained, restored = (
        lines[2].removeprefix("test accuracy ").split("; restored from the checkpoint of epoch 1: ")
    )
    assert trained == restored, "the restored checkpoint scores exactly what the trained model did"
    assert lines[-1] in ("reached the target accuracy of 0.95", "did NOT reach the target accuracy of 0.95")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = checkpoint.restore(tmp_path / "checkpoints")
    assert saved["model"]["hidden1"]["kernel"]["value"].shape == (64, 256)
    # Where the input stood: the end of the epoch, whose iterator has its own state.
    position = saved.pop("data")
    assert position["batches"] == 45 and position["source_states"] == [{"json": {"epoch": 0, "batch": 45}}]
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(saved))

    again = _run_demo("--epochs", "2", "--output-dir", str(tmp_path))  # Two in all: one more.
    assert again.returncode == 0, again.stderr
    assert f"resumed at epoch 2, batch 0 of 45 (step 45), from {tmp_path / 'checkpoints'}" in again.stdout
    assert "epoch 2: loss " in again.stdout and "epoch 1:" not in again.stdout

    done_already = _run_demo("--epochs", "2", "--output-dir", str(tmp_path))  # The same command again.
    assert done_already.returncode == 0, done_already.stderr
    assert "all 2 epochs were trained already (step 90 in " in done_already.stdout
    assert "epoch 2: loss " not in done_already.stdout


def _losses_and_accuracies(stdout: str) -> list[str]:
    """`epoch N: loss L, test accuracy A` of each epoch line, without the speed."""
    return [line.rsplit(",", 1)[0] for line in stdout.splitlines() if line.startswith("epoch ")]


@pytest.fixture(scope="module")
def sgd_two_epochs(tmp_path_factory) -> subprocess.CompletedProcess[str]:
    """Two epochs of plain SGD on one device, uninterrupted."""
    done = _run_demo(
        "--optimizer", "sgd", "--epochs", "2", "--output-dir", str(tmp_path_factory.mktemp("sgd"))
    )
    assert done.returncode == 0, done.stderr
    return done


def test_sigterm_mid_epoch_saves_and_the_next_run_resumes_there_exactly(tmp_path, sgd_two_epochs):
    args = ("--optimizer", "sgd", "--epochs", "2", "--output-dir", str(tmp_path))
    stopped = _run_demo(*args, "--preempt-at", "50")  # SIGTERM from a thread once step 50 ran.
    assert stopped.returncode == 42, stopped.stderr
    assert "epoch 2:" not in stopped.stdout
    saved = checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step()
    assert 50 < saved < 90  # Mid-epoch: the second epoch's steps are 45 to 89.
    assert (
        f"PreemptionHandler: preempted by SIGTERM: saved step {saved} to {tmp_path / 'checkpoints'}"
        in stopped.stderr
    )
    assert f"exiting with status 42. Run the program again to resume at step {saved}." in stopped.stderr

    resumed = _run_demo(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed at epoch 2, batch {saved - 45} of 45 (step {saved}), from " in resumed.stdout
    # The same second epoch as without the stop: its last loss and its accuracy.
    assert _losses_and_accuracies(resumed.stdout) == _losses_and_accuracies(sgd_two_epochs.stdout)[1:]


def test_replicas_train_the_same_script_with_mirrored_strategy(tmp_path, sgd_two_epochs):
    # Plain SGD, which steps by the gradient's scale: replicas' gradients that were summed, or
    # averaged over uneven parts, would show here.
    one = sgd_two_epochs
    two = _run_demo(
        "--optimizer", "sgd", "--replicas", "2", "--epochs", "2", "--output-dir", str(tmp_path / "two")
    )
    assert two.returncode == 0, two.stderr
    lines = two.stdout.splitlines()
    assert lines[0] == (
        "MirroredStrategy(devices=(CpuDevice(id=0), CpuDevice(id=1))): 1437 training and 360 test images"
    )
    assert "; restored from the checkpoint of epoch 2: " in lines[3]
    # The same batches (the last of each pass, 29 examples, padded to split evenly and masked)
    # and the same gradients: the same losses and test accuracy as on one device.
    assert _losses_and_accuracies(two.stdout) == _losses_and_accuracies(one.stdout)
    assert len(_losses_and_accuracies(one.stdout)) == 2


def test_help_explains_the_flags():
    done = _run_demo("--help")
    for flag in (
        "--device",
        "--replicas",
        "--optimizer",
        "--learning-rate",
        "--epochs",
        "--batch-size",
        "--output-dir",
        "--preempt-at",
    ):
        assert flag in done.stdout


def test_bad_flags_are_clear_errors(tmp_path):
    done = _run_demo("--device", "/cpu:99", "--output-dir", str(tmp_path))
    assert done.returncode != 0 and "no such device" in done.stderr and "Traceback" not in done.stderr
    done = _run_demo("--epochs", "0")
    assert done.returncode == 2 and "--epochs must be at least 1" in done.stderr
    done = _run_demo("--replicas", "3")
    assert done.returncode == 2 and "--batch-size 32 must be a multiple of --replicas 3" in done.stderr
    done = _run_demo("--optimizer", "lbfgs")
    assert done.returncode == 2 and "invalid choice: 'lbfgs'" in done.stderr
