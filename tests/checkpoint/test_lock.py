"""The directory lock: independent writers never lose a save; killed holders are taken over; jobs share one."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax.numpy as jnp
import pytest

from jaxstrategy import checkpoint
from jaxstrategy.testing import run_local_workers

_WRITER = textwrap.dedent(
    """
    import json, sys, time
    import jax.numpy as jnp
    from jaxstrategy import checkpoint

    directory, writer, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    time.sleep(max(0.0, start - time.time()))  # Both writers start together.
    for attempt in range(4):
        value = 100 * writer + attempt
        try:
            step = checkpoint.save(directory, {"who": jnp.full((512, 512), value, jnp.float32)})
            print(json.dumps(["saved", step, value]), flush=True)
        except Exception as error:
            print(json.dumps([type(error).__name__, str(error)]), flush=True)
    """
)


@pytest.mark.slow  # Starts processes.
def test_two_independent_writers_never_lose_a_save(tmp_path):
    start = time.time() + 8  # Past both imports of JAX.
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(writer), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for writer in (1, 2)
    ]
    outputs = []
    try:
        for writer in writers:
            out, err = writer.communicate(timeout=180)  # A hang fails here.
            assert writer.returncode == 0, err
            assert "Traceback" not in err, err
            outputs.append([json.loads(line) for line in out.splitlines()])
    finally:
        for writer in writers:
            writer.kill()
    saved = [
        (step, value)
        for lines in outputs
        for kind, *rest in lines
        if kind == "saved"
        for step, value in [rest]
    ]
    refused = [
        (index, rest[0]) for index, lines in enumerate(outputs) for kind, *rest in lines if kind != "saved"
    ]
    assert saved, outputs
    for index, message in refused:  # Only refusals, each naming the directory and the other writer.
        other = writers[1 - index].pid
        assert re.search(_locked(tmp_path, other), message), message
    steps = [step for step, _ in saved]
    assert len(set(steps)) == len(steps), f"two saves reported as one step: {saved}"
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == sorted(steps)
        for step, value in saved:  # Every save reported is there, intact.
            assert checkpointer.restore(step)["who"][0, 0].tolist() == value
    assert not (tmp_path / ".jaxstrategy.lock").exists()


def _locked(directory: Path, pid: int) -> str:
    """The pattern of a CheckpointLockedError's message (one line) for a save into `directory`: the
    call, the directory, the holder and since when, and the fix."""
    return (
        rf"checkpoint\.save\(\): cannot save into {re.escape(str(directory))}: another writer's save .*: "
        rf"process {pid} on host {re.escape(repr(socket.gethostname()))} \(holding it since .*\)\. .*"
        r"Stop that writer, or save to another directory\.$"
    )


@pytest.mark.slow  # Starts processes.
def test_a_checkpointer_holds_its_directory_while_a_save_is_in_flight(tmp_path):
    program = "import sys, jax.numpy as jnp; from jaxstrategy import checkpoint; checkpoint.save(sys.argv[1], {'w': jnp.ones(1)})"
    holder = checkpoint.Checkpointer(tmp_path)
    holder.save(0, {"w": jnp.zeros(1)})  # On disk once the holder waits.
    other = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert other.returncode == 1
    assert re.search(f"CheckpointLockedError: {_locked(tmp_path, os.getpid())}", other.stderr), other.stderr
    with pytest.raises(
        checkpoint.CheckpointLockedError,
        match=r"(?s)another Checkpointer of this process.*Save through one Checkpointer per directory, or "
        r"wait\(\) for the other's save first\.$",
    ) as info:
        checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    assert isinstance(info.value, RuntimeError)
    assert holder.save(1, {"w": jnp.ones(1)}), "the holder saves on"
    holder.wait()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["0", "1"], "no lock file at rest"
    assert checkpoint.save(tmp_path, {"w": jnp.ones(1)}) == 2, "and the next writer gets in"
    holder.close()


_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import jax.numpy as jnp
    from jaxstrategy import checkpoint

    directory, forks = Path(sys.argv[1]), sys.argv[2] == "forks"
    checkpointer = checkpoint.Checkpointer(directory)
    checkpointer.save(0, {"w": jnp.zeros(1)})  # Locked until it waits, which it never does.
    while not (directory / "0").is_dir():  # On disk.
        time.sleep(0.01)
    if forks and os.fork() == 0:  # A worker that outlives it, as data loaders' may.
        time.sleep(600)
        os._exit(0)
    print("holding", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow  # Starts processes.
@pytest.mark.parametrize("forks", [False, True], ids=["alone", "with-a-forked-child-alive"])
def test_the_lock_of_a_killed_writer_is_taken_over_with_a_warning(tmp_path, forks):
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), "forks" if forks else "alone"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # Its forked child too is killed at the end, with the group.
    ) as holder:
        try:
            assert holder.stdout.readline() == "holding\n"
            os.kill(holder.pid, signal.SIGKILL)  # The child, if any, lives on.
            holder.wait(timeout=60)
            _assert_taken_over(tmp_path, holder.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):  # None left, without a child.
                os.killpg(holder.pid, signal.SIGKILL)


def _assert_taken_over(tmp_path: Path, pid: int) -> None:
    (tmp_path / "1.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # What a killed save leaves.
    with pytest.warns(
        UserWarning,
        match=rf"(?s)took over the lock of {re.escape(str(tmp_path))} from process {pid} on host "
        rf"{re.escape(repr(socket.gethostname()))} .*ended without releasing it.*unfinished saves .*removed",
    ):
        assert checkpoint.save(tmp_path, {"w": jnp.ones(1)}, step=1) == 1
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["0", "1"]


_JOB = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jaxstrategy
    from jaxstrategy import checkpoint

    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    directory = sys.argv[1]
    w = strategy.put(np.arange(6, dtype=np.float32))
    with checkpoint.Checkpointer(directory, max_to_keep=2) as checkpointer:
        for step in range(3):
            checkpointer.save(step, {"w": w * step})
    print(checkpoint.save(directory, {"w": w * 10}), flush=True)
    """
)


@pytest.mark.slow  # Starts processes.
def test_the_processes_of_one_job_save_into_one_directory(tmp_path):
    results = run_local_workers(["-c", _JOB, str(tmp_path)], timeout=240)
    outcomes = [(result.returncode, result.stdout.splitlines()[-1:]) for result in results]
    assert outcomes == [(0, ["3"])] * 2, [result.stderr[-3000:] for result in results]
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1, 2, 3]
        assert checkpointer.restore(3)["w"].tolist() == [10.0 * i for i in range(6)]


# --- failed writes -----------------------------------------------------------------------------
