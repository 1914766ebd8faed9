"""A multi-worker job on this machine: one program started as several processes, for tests.

Each process gets a `TF_CONFIG` naming all of them on 127.0.0.1, at ports reserved for the job
until it ends (see `ports.py`: jobs started at once never share one), and its own task index,
and JAX's CPU backend with a forced number of devices, so that `MultiWorkerMirroredStrategy()`
in the program joins them into one job on any laptop. Every wait is bounded: past the timeout
every process is killed and the error shows what each printed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from jaxstrategy._src.cluster.ports import reserve_ports
from jaxstrategy._src.core.arguments import check_int
from jaxstrategy._src.core.errors import format_call

# The call that messages name: the public one, as users write it.
_CALLER = "jaxstrategy.testing.run_local_workers()"
# How much of each process's output a timeout error shows.
_TAIL_CHARS = 3000


def worker_environment(
    tf_config: Mapping[str, object], devices_per_worker: int, env: Mapping[str, str] | None
) -> dict[str, str]:
    """The environment of one worker: TF_CONFIG, and JAX on the CPU with that many devices."""
    environment = dict(os.environ if env is None else env)
    flags = re.sub(
        r"--xla_force_host_platform_device_count=\S*", "", environment.get("XLA_FLAGS", "")
    ).split()
    environment.update(
        TF_CONFIG=json.dumps(tf_config),
        XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_worker}"]),
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",  # All of a killed worker's output reaches the file.
    )
    return environment


class LocalWorkers:
    """The processes of one local job, started together; see `run_local_workers`.

    Its ports stay reserved until its processes have ended (`wait`, `kill`).
    """

    def __init__(
        self,
        args: Sequence[str],
        num_workers: int,
        *,
        devices_per_worker: int,
        env: Mapping[str, str] | None,
        cwd: str | os.PathLike[str] | None,
    ):
        self._ports = reserve_ports(num_workers, caller=_CALLER)
        addresses = [f"127.0.0.1:{port}" for port in self._ports.ports]
        self._outputs: list[tuple[IO[str], IO[str]]] = []
        self.processes: list[subprocess.Popen[str]] = []
        try:
            self._start(args, addresses, devices_per_worker, env, cwd)
        except BaseException:
            self._abandon()
            raise

    def _start(
        self,
        args: Sequence[str],
        addresses: list[str],
        devices_per_worker: int,
        env: Mapping[str, str] | None,
        cwd: str | os.PathLike[str] | None,
    ) -> None:
        for index in range(len(addresses)):
            tf_config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
            stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            self._outputs.append((stdout, stderr))
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    stdout=stdout,
                    stderr=stderr,
                    text=True,
                    cwd=cwd,
                    env=worker_environment(tf_config, devices_per_worker, env),
                    start_new_session=True,  # So a kill reaches the worker's own children too.
                )
            )

    def wait(self, timeout: float) -> list[subprocess.CompletedProcess[str]]:
        """Wait for every process to end, once; kill them all past `timeout` seconds. Then the
        job's ports are free for other jobs.

        Raises:
          TimeoutError: some process was still running at the timeout; the message shows the
            end of each process's output.
        """
        deadline = time.monotonic() + timeout
        try:
            for process in self.processes:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            results = self._results()
            raise TimeoutError(
                f"The {len(results)} local workers did not all end within {timeout:.0f} s, and were "
                f"killed. Their output:\n{describe_results(results)}"
            ) from None
        except BaseException:  # Ctrl-C, say: no worker outlives the wait.
            self._abandon()
            raise
        self._ports.release()  # Every process ended.
        return self._results()

    def _abandon(self) -> None:
        self.kill()
        for stdout, stderr in self._outputs:
            stdout.close()
            stderr.close()

    def kill(self) -> None:
        """Kill every process still running (and its children), reap it, and free the ports."""
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            process.wait()
        self._ports.release()

    def _results(self) -> list[subprocess.CompletedProcess[str]]:
        """What each process printed; read once, after every process ended."""
        results = []
        for process, (stdout, stderr) in zip(self.processes, self._outputs, strict=True):
            texts = []
            for stream in (stdout, stderr):
                with stream:
                    stream.seek(0)
                    texts.append(stream.read())
            results.append(subprocess.CompletedProcess(process.args, process.returncode, *texts))
        return results


def describe_results(results: Sequence[subprocess.CompletedProcess[str]]) -> str:
    """Each worker's exit status and the end of its output, for an error message."""
    parts = []
    for index, result in enumerate(results):
        status = "still running" if result.returncode is None else f"exit status {result.returncode}"
        parts.append(
            f"--- worker {index}: {status}\n--- stdout (end):\n{result.stdout[-_TAIL_CHARS:]}"
            f"\n--- stderr (end):\n{result.stderr[-_TAIL_CHARS:]}"
        )
    return "\n".join(parts)


def run_local_workers(
    args: Sequence[str],
    num_workers: int = 2,
    *,
    devices_per_worker: int = 1,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[subprocess.CompletedProcess[str]]:
    """Run `python *args` as the `num_workers` processes of one job on this machine; wait for all.

    Each process gets a `TF_CONFIG` listing every process at a port of 127.0.0.1 and its own
    task index (`'worker'`, 0 to `num_workers - 1`), and JAX's CPU backend with
    `devices_per_worker` devices, so a `MultiWorkerMirroredStrategy()` in the program joins them
    all: a real multi-process job for a test suite, without a cluster. The ports are reserved for
    the job until it ends: jobs started at once, from threads or processes of this machine (a
    test suite run with pytest-xdist, say), never get the same port.

    Args:
      args: the program and its arguments, as after `python`, e.g. `['train.py', '--steps', '5']`.
      num_workers: how many processes.
      devices_per_worker: how many CPU devices each process's JAX has.
      timeout: seconds to wait for all of them; then every one is killed.
      env: the environment to start from (this process's when None).
      cwd: the directory to run in.

    Returns:
      One `subprocess.CompletedProcess` per worker, in task order, with its output as text.

    Raises:
      TimeoutError: the workers did not all end in time; the message shows what each printed.
      RuntimeError: no free port is left for the job (other local jobs hold them all).
      TypeError: `args` is a string rather than a list of strings.
      ValueError: `num_workers` or `devices_per_worker` is not an int >= 1, or `timeout` is not
        positive.

    Example:
      >>> from jaxstrategy.testing import run_local_workers
      >>> program = ('import jaxstrategy; s = jaxstrategy.MultiWorkerMirroredStrategy(); '
      ...            'print(s.cluster_resolver.task_id, s.num_replicas_in_sync)')
      >>> results = run_local_workers(['-c', program], devices_per_worker=2, timeout=120)
      >>> [r.stdout for r in results]
      ['0 4\\n', '1 4\\n']
    """
    if isinstance(args, str | bytes) or not all(isinstance(arg, str) for arg in args):
        # A bare string is a sequence too: it would run one argument per character.
        raise TypeError(
            f"{format_call(_CALLER, f'args={args!r}')}: expected a list of strings, the program and its "
            f"arguments as after `python`, such as ['train.py', '--steps', '5']."
        )
    for name, value in (("num_workers", num_workers), ("devices_per_worker", devices_per_worker)):
        check_int(value, format_call(_CALLER, f"{name}={value!r}"), at_least=1)
    if not timeout > 0:
        raise ValueError(f"{format_call(_CALLER, f'timeout={timeout!r}')}: expected a number of seconds > 0.")
    workers = LocalWorkers(
        args, num_workers, devices_per_worker=devices_per_worker, env=env, cwd=Path(cwd) if cwd else None
    )
    return workers.wait(timeout)
