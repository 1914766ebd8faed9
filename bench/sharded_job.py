"""The job rows of bench/sharded.py: `MultiWorkerShardedStrategy` over 2 processes x 2 CPU devices
against `ShardedStrategy` over 4 CPU devices of one process, for (R, S) = (2, 2) and (1, 4).

Not a script: `sharded.py` runs `section` in its own process (which holds the one-process
reference) and starts the job's two processes as `sharded.py --job-worker CONTROL_DIR`, which run
`worker`. The two sides take turns, in lockstep: this process writes a command file to
CONTROL_DIR, each worker waits for it (polling every few ms, idle), carries it out and writes its
result there, and this process waits for both before it carries out its own next command. So the
job and the reference never run at once, and every round times both, as one process times its
cases side by side. See sharded.py's docstring for what each row means.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from bench_util import bytes_read, count_compiles, state_bytes_per_device

import jaxstrategy
from jaxstrategy import checkpoint

JOB_LAYOUTS = ((2, 2), (1, 4))  # (R, S)
# The one-process rows' model (sharded.py's FULL). Measured here: a round of the 4 cases' epochs
# takes about 10 s (mostly (2,2)'s), a round of the 12 checkpoint operations about 15 s; 3 min in
# all. QUICK: about 30 s, of which the job's start and compiles take 15.
FULL = {"hidden": 2048, "batch": 64, "steps": 5, "rounds": 10, "checkpoint_rounds": 3}
QUICK = {"hidden": 512, "batch": 16, "steps": 2, "rounds": 2, "checkpoint_rounds": 1}
JOB, LOCAL = "2 processes", "1 process"
POLL_S = 0.005
TIMEOUT_S = 900.0  # The longest either side waits for the other's next move.
MiB = 2**20

# What `sharded.strategy_case` is: a training case on a strategy, with `epoch()` (seconds per
# step of one pass) and `state()` (the parameters and optimizer state it holds now).
MakeCase = Callable[[str, jaxstrategy.Strategy, list[Any], int], Any]


def layout_name(r: int, s: int) -> str:
    return f"({r},{s})"


class Side:
    """One side's cases, one per layout, and the commands both sides carry out alike."""

    def __init__(
        self,
        side: str,
        strategies: dict[str, jaxstrategy.ShardedStrategy],
        settings: dict[str, Any],
        make_case: MakeCase,
    ):
        rng = np.random.default_rng(0)  # The same batches on every process and both sides.
        shape = (settings["batch"], settings["hidden"])
        batches = [
            tuple(rng.normal(size=shape).astype(np.float32) for _ in range(2))
            for _ in range(settings["steps"])
        ]
        self.strategies = strategies
        self.cases = {
            name: make_case(f"{side} {name}", strategy, batches, settings["hidden"])
            for name, strategy in strategies.items()
        }
        for case in self.cases.values():  # Compile, and fill caches, outside the timing.
            case.epoch()
        self.compiles = count_compiles()
        self.timed_compiles = 0

    def act(self, command: dict[str, Any]) -> dict[str, Any]:
        action, name = command["action"], command.get("layout")
        if action == "state":
            return {"state_bytes": {n: state_bytes_per_device(c.state()) for n, c in self.cases.items()}}
        case = self.cases[name]
        if action == "epoch":
            before = self.compiles["backend"]
            seconds = case.epoch()
            self.timed_compiles += self.compiles["backend"] - before
            return {"seconds": seconds}
        if action == "save":
            # Returns once the step is on disk; the state is not donated until the next epoch.
            started = time.perf_counter()
            checkpoint.save(command["directory"], case.state(), step=0)
            return {"seconds": time.perf_counter() - started}
        if action == "restore":  # Onto this layout, from a checkpoint of it or of the other.
            read_before = bytes_read()
            started = time.perf_counter()
            restored = checkpoint.restore(
                command["directory"], strategy=self.strategies[name], target=case.state()
            )
            jax.block_until_ready(restored)
            seconds = time.perf_counter() - started
            read_after = bytes_read()
            read = None if read_before is None or read_after is None else read_after - read_before
            return {"seconds": seconds, "read": read}
        raise ValueError(f"unknown command {command!r}")


def _write_json(path: Path, value: Any) -> None:
    """Write `path` whole or not at all: the other side polls for its name."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


def _read_json_when_written(path: Path, alive: Callable[[], bool]) -> Any:
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if not alive() or time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {path}: the other side ended or took {TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    return json.loads(path.read_text())


def worker(control: Path, make_case: MakeCase, traces: dict[str, int]) -> None:
    """One process of the job: carry out each command in CONTROL_DIR until told to stop."""
    parent = os.getppid()
    # First, before any other JAX call; the job's processes share a host, so R is passed.
    strategies = {
        layout_name(r, s): jaxstrategy.MultiWorkerShardedStrategy(num_replicas=r) for r, s in JOB_LAYOUTS
    }
    for (r, s), strategy in zip(JOB_LAYOUTS, strategies.values(), strict=True):
        assert (strategy.num_replicas_in_sync, strategy.devices_per_replica) == (r, s), strategy
    side = Side(JOB, strategies, json.loads((control / "settings.json").read_text()), make_case)
    number = 0
    while True:
        command = _read_json_when_written(control / f"command-{number}.json", lambda: os.getppid() == parent)
        stop = command["action"] == "stop"
        result = (
            {"traces": dict(traces), "timed_compiles": side.timed_compiles} if stop else side.act(command)
        )
        _write_json(control / f"result-{number}-{jax.process_index()}.json", result)
        if stop:
            return
        number += 1


class Job:
    """The job's two processes, driven by commands."""

    def __init__(self, control: Path, settings: dict[str, Any]):
        from jaxstrategy._src.cluster.local_workers import LocalWorkers

        self.control = control
        _write_json(control / "settings.json", settings)
        script = sys.modules["__main__"].__file__
        assert script is not None
        self.workers = LocalWorkers(
            [script, "--job-worker", str(control)], 2, devices_per_worker=2, env=None, cwd=None
        )
        self.number = 0

    def act(self, command: dict[str, Any]) -> list[dict[str, Any]]:
        """Each process's result of `command`, by process index."""
        _write_json(self.control / f"command-{self.number}.json", command)
        try:
            results = [
                _read_json_when_written(self.control / f"result-{self.number}-{i}.json", self.alive)
                for i in range(2)
            ]
        except RuntimeError:
            self.fail()
        self.number += 1
        return results

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.workers.processes)

    def fail(self) -> None:
        from jaxstrategy._src.cluster.local_workers import describe_results

        # A worker ended (or hangs): the other is stuck in a collective; each one's output says why.
        results = self.workers.wait(timeout=30)  # Past it, kills both and raises with their output.
        sys.exit(f"FAIL: a worker of the job ended early:\n{describe_results(results)}")


def section(quick: bool, make_case: MakeCase, traces: dict[str, int]) -> bool:
    """Run the job rows and print their tables; return True when nothing was retraced and XLA
    compiled nothing while timed."""
    settings = QUICK if quick else FULL
    print(
        "\n\n2 processes x 2 CPU devices: MultiWorkerShardedStrategy against ShardedStrategy in one process"
    )
    gpus = _gpu_count()
    print(
        f"NCCL rows: skipped: they need a machine with two or more GPUs, and this one has {gpus}; "
        "the job below is two CPU processes (gloo over TCP on 127.0.0.1)."
    )
    if bytes_read() is None:
        print("bytes read: skipped: /proc/self/io does not exist here (it is Linux's).")
    with tempfile.TemporaryDirectory(prefix="sharded-job-") as root:
        control = Path(root) / "control"
        control.mkdir()
        job = Job(control, settings)
        try:
            found, ok = _measure(job, settings, Path(root), make_case, traces)
            job.workers.wait(timeout=60)
        finally:
            job.workers.kill()
    _report(found, settings)
    return ok


def _gpu_count() -> int:
    try:
        return len(jax.devices("gpu"))
    except RuntimeError:
        return 0


def _measure(
    job: Job, settings: dict[str, Any], root: Path, make_case: MakeCase, traces: dict[str, int]
) -> tuple[dict[str, Any], bool]:
    """Every round's results, by (side, layout) then by what; and whether no step was retraced
    and nothing compiled while timed."""
    strategies = {
        layout_name(r, s): jaxstrategy.ShardedStrategy(jax.devices()[:4], num_replicas=r)
        for r, s in JOB_LAYOUTS
    }
    local = Side(LOCAL, strategies, settings, make_case)  # While the job starts and compiles.
    names = list(strategies)

    def each(command: dict[str, Any], side: str) -> list[dict[str, Any]]:
        """The command's results: the job's, one per process, or this process's alone."""
        return job.act(command) if side == JOB else [local.act(command)]

    entries = [(side, name) for side in (JOB, LOCAL) for name in names]
    found: dict[Any, Any] = {entry: collections.defaultdict(list) for entry in entries}
    # The job answers once it is ready: nothing is timed before then.
    found["state"] = {side: each({"action": "state"}, side) for side in (JOB, LOCAL)}
    for round_index in range(settings["rounds"]):
        shift = round_index % len(entries)
        for side, name in entries[shift:] + entries[:shift]:
            found[side, name]["epoch"].append(each({"action": "epoch", "layout": name}, side))
    for round_index in range(settings["checkpoint_rounds"]):
        shift = round_index % len(entries)
        order = entries[shift:] + entries[:shift]
        where = {
            (side, name): str(root / f"{'job' if side == JOB else 'local'}-{name}-{round_index}")
            for side, name in entries
        }
        for side, name in order:
            command = {"action": "save", "layout": name, "directory": where[side, name]}
            found[side, name]["save"].append(each(command, side))
            found[side, name]["on disk"].append(_bytes_on_disk(Path(where[side, name])))
        for side, name in order:
            command = {"action": "restore", "layout": name, "directory": where[side, name]}
            found[side, name]["restore"].append(each(command, side))
        for side, name in order:  # The other layout's checkpoint, onto this one.
            other = where[side, names[1 - names.index(name)]]
            command = {"action": "restore", "layout": name, "directory": other}
            found[side, name]["cross"].append(each(command, side))
        for directory in where.values():
            shutil.rmtree(directory)
    stopped = job.act({"action": "stop"})
    job_traces = [result["traces"] for result in stopped]
    print(f"traces: in the job, per process: {job_traces}; here: {dict(sorted(traces.items()))}")
    timed = [result["timed_compiles"] for result in stopped] + [local.timed_compiles]
    print(f"XLA compiles while timed (process 0, process 1, here): {timed}")
    counts = [count for t in job_traces for count in t.values()]
    counts += [count for name, count in traces.items() if name.startswith(LOCAL)]
    return found, all(count == 1 for count in counts) and not any(timed)


def _bytes_on_disk(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _mib(size: float) -> str:
    return f"{size / MiB:.1f} MiB"


def _report(found: dict[Any, Any], settings: dict[str, Any]) -> None:
    hidden = settings["hidden"]
    state_mib = 4 * (hidden + 1) * hidden * 4 * 3 / MiB
    print(
        f"4 dense layers of {hidden}x{hidden}, Adam, batch {settings['batch']} ({state_mib:.1f} MiB "
        f"of state); {settings['rounds']} rounds of {settings['steps']} steps per case, "
        f"{settings['checkpoint_rounds']} of checkpoints; the one-process reference runs in this "
        "process, in lockstep with the job (never at once)"
    )
    names = [layout_name(r, s) for r, s in JOB_LAYOUTS]

    def per_round(side: str, name: str, what: str) -> list[float]:
        """Each round's seconds: the slowest process's."""
        return [max(r["seconds"] for r in results) for results in found[side, name][what]]

    def ratio(name: str, what: str) -> float:
        job, local = per_round(JOB, name, what), per_round(LOCAL, name, what)
        return statistics.median(a / b for a, b in zip(job, local, strict=True))

    print(
        f"\n{'layout (R,S)':<14}{'state/device p0':>17}{'p1':>10}{'1 process':>11}"
        f"{'ms/step 2 processes':>24}{'1 process':>24}{'ratio 2p/1p':>13}"
    )
    for name in names:
        states = found["state"][JOB] + found["state"][LOCAL]
        cells = [_mib(result["state_bytes"][name]) for result in states]
        times = []
        for side in (JOB, LOCAL):
            p10, p50, p90 = np.percentile(np.asarray(per_round(side, name, "epoch")) * 1e3, [10, 50, 90])
            times.append(f"{p50:.1f} ({p10:.1f}-{p90:.1f})")
        print(
            f"{name:<14}{cells[0]:>17}{cells[1]:>10}{cells[2]:>11}{times[0]:>24}{times[1]:>24}"
            f"{ratio(name, 'epoch'):>13.3f}"
        )
    print(
        "state/device: parameters and optimizer state, the most any device of that process holds "
        "(from the arrays' addressable shards; each job process reports its own); ms/step: median "
        "(p10-p90) over rounds, the job's the slower process's; ratio: median of the per-round "
        "ratios (below 1: the job is faster)."
    )

    print(
        f"\n{'checkpoint':<26}{'s 2 processes':>15}{'1 process':>11}{'ratio 2p/1p':>13}{'on disk':>11}"
        f"{'read p0':>18}{'read p1':>18}{'read 1 process':>19}"
    )
    for name in names:
        other = names[1 - names.index(name)]
        for what, label, disk_of in (
            ("save", f"save {name}", name),
            ("restore", f"restore {name}", name),
            ("cross", f"restore {other}'s onto {name}", other),
        ):
            on_disk = statistics.median(found[JOB, disk_of]["on disk"])
            job_s = statistics.median(per_round(JOB, name, what))
            local_s = statistics.median(per_round(LOCAL, name, what))
            line = f"{label:<26}{job_s:>15.2f}{local_s:>11.2f}{ratio(name, what):>13.3f}{_mib(on_disk):>11}"
            if what != "save" and found[JOB, name][what][0][0]["read"] is not None:
                reads = [[r[i]["read"] for r in found[JOB, name][what]] for i in range(2)]
                reads.append([r[0]["read"] for r in found[LOCAL, name][what]])
                for read, width in zip(map(statistics.median, reads), (18, 18, 19), strict=True):
                    line += f"{f'{_mib(read)} ({read / on_disk:.2f})':>{width}}"
            print(line)
    print(
        "s: seconds, median over rounds (the job's: the slower process's); save: checkpoint.save, "
        "until on disk; restore: checkpoint.restore onto the layout, the state as target, checksums "
        "checked, until the arrays are ready; ratio: median of the per-round ratios. on disk: every "
        "file of the step. read: the rchar delta of /proc/self/io over the restore, per process "
        "(in brackets: over on disk); the files were just written, so reads come from the page cache."
    )
