"""PreemptionHandler: SIGTERM mid-training, a save, exit status 42, and a restart that resumes
exactly: the losses of the two runs, concatenated, equal an uninterrupted run's bit for bit.

The proof runs on one device, on MirroredStrategy over four devices, on ShardedStrategy of two
replicas of two devices (in this process, the restart being a new handler, dataset and
iterator), and as a job of two processes on 127.0.0.1 (three real jobs: uninterrupted, killed,
restarted), mirrored and sharded (one replica over both processes, each saving its half). The step at which SIGTERM comes is random; its seed
is in every failure message (set JAXSTRATEGY_PREEMPTION_SEED to replay one).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec
from preemption_worker import train

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import preemption
from jaxstrategy._src.cluster import coordination
from jaxstrategy._src.cluster.local_workers import describe_results
from jaxstrategy.testing import run_local_workers

WORKER = Path(__file__).resolve().parents[1] / "preemption_worker.py"
SEED = int(os.environ.get("JAXSTRATEGY_PREEMPTION_SEED", time.time_ns() % 1_000_000))
TIMEOUT_S = 180


def _losses(strategy, directory, *, stateful, kill_at=None):
    """The run's losses by step, and how it ended: 'done', or the SystemExit status."""
    losses = {}
    try:
        handler = train(
            strategy,
            str(directory),
            epochs=3,
            stateful=stateful,
            kill_at=kill_at,
            report=lambda step, loss: losses.__setitem__(step, loss),
        )
    except SystemExit as exit:
        return losses, exit.code
    assert not handler.preempted
    return losses, "done"


@pytest.mark.parametrize(
    ("make_strategy", "stateful"),
    [
        (jaxstrategy.OneDeviceStrategy, False),
        (jaxstrategy.MirroredStrategy, True),
        # Two replicas of two devices, w split over each replica's two; b, which two does not
        # divide, replicated on purpose. (The stateful source counts one replica per device.)
        (
            lambda: jaxstrategy.ShardedStrategy(
                num_replicas=2, min_shard_bytes=0, layout=[("b", PartitionSpec())]
            ),
            False,
        ),
    ],
    ids=["one-device, list source", "mirrored-4, stateful source", "sharded-2x2, list source"],
)
def test_sigterm_then_restart_trains_bit_for_bit_as_without(tmp_path, caplog, make_strategy, stateful):
    strategy = make_strategy()
    baseline, ended = _losses(strategy, tmp_path / "baseline", stateful=stateful)
    assert ended == "done"
    kill_at = random.Random(SEED).randrange(len(baseline) - 2)
    context = f"seed {SEED}, SIGTERM after step {kill_at} of {len(baseline)}"

    with caplog.at_level(logging.WARNING, logger="jaxstrategy"):
        first, status = _losses(strategy, tmp_path / "run", stateful=stateful, kill_at=kill_at)
    assert status == checkpoint.PREEMPTED_EXIT_CODE == 42, context
    saved = checkpoint.Checkpointer(tmp_path / "run").latest_step()
    assert sorted(first) == list(range(saved)) and saved > kill_at, context
    assert re.search(
        rf"PreemptionHandler: preempted by SIGTERM: saved step {saved} to .* exiting with status 42\. "
        rf"Run the program again to resume at step {saved}\.",
        caplog.text,
    ), caplog.text
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # Put back.

    second, ended = _losses(strategy, tmp_path / "run", stateful=stateful)
    assert ended == "done", context
    assert sorted(second) == list(range(saved, len(baseline))), context
    assert {**first, **second} == baseline, context  # Bit for bit: float equality of every loss.


def _job_losses(results):
    """Step -> loss (hex) from process 0's lines; fails showing the workers' output otherwise."""
    lines = re.findall(r"^loss (\d+) (\S+)$", results[0].stdout, re.MULTILINE)
    return {int(step): loss for step, loss in lines}


def _job_params(results):
    """Each process's final parameters, gathered whole, as it printed them (floats in hex)."""
    return [re.findall(r"^param .*$", result.stdout, re.MULTILINE) for result in results]


# The jobs of two processes of two devices each: the worker's arguments, how many of w's 8 rows
# (and of its momentum's) each process holds, and each process's source state once resumed.
JOBS = {
    # Four replicas, each process feeding its two: process 0 reads a list (restored by skipping),
    # process 1 a source with its own state (restored from it).
    "mirrored": (
        ["--strategy", "multi-worker"],
        8,
        ["'source_states': [None]", "'source_states': [{'bytes': "],
    ),
    # One replica over the four devices of both processes: each holds half of w and of its
    # momentum, so each saves, and restores, its own half; both read the replica's one pipeline.
    "sharded R=1": (
        ["--strategy", "multi-worker-sharded", "--replicas", "1"],
        4,
        ["'source_states': [None]", "'source_states': [None]"],
    ),
}


def _run_job(directory, job, *extra):
    return run_local_workers(
        [str(WORKER), str(directory), *JOBS[job][0], *extra],
        num_workers=2,
        devices_per_worker=2,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def uninterrupted_jobs(tmp_path_factory):
    """A job's losses and final parameters when it runs without a stop, run once per module."""
    runs = {}

    def uninterrupted(job):
        if job not in runs:
            baseline = _run_job(tmp_path_factory.mktemp("baseline"), job)
            assert [r.returncode for r in baseline] == [0, 0], describe_results(baseline)
            runs[job] = _job_losses(baseline), _job_params(baseline)
        return runs[job]

    return uninterrupted


@pytest.mark.slow  # Three jobs of two processes.
@pytest.mark.parametrize(
    ("job", "killed"),
    [("mirrored", 1), ("mirrored", -1), ("sharded R=1", 1)],
    ids=["mirrored, SIGTERM to process 1", "mirrored, SIGTERM to both", "sharded R=1, SIGTERM to process 1"],
)
def test_two_processes_stop_at_one_step_save_their_own_positions_and_resume_bit_for_bit(
    tmp_path, uninterrupted_jobs, job, killed
):
    expected, expected_params = uninterrupted_jobs(job)
    _, rows, source_states = JOBS[job]
    total = len(expected)
    kill_at = random.Random(SEED + killed).randrange(total - 2)
    context = f"{job}: seed {SEED}, SIGTERM to process {killed} after step {kill_at} of {total}"

    stopped = _run_job(tmp_path, job, "--kill-at", str(kill_at), "--kill-process", str(killed))
    details = f"{context}\n{describe_results(stopped)}"
    assert [r.returncode for r in stopped] == [42, 42], details
    saved = checkpoint.Checkpointer(tmp_path).latest_step()
    assert saved is not None and saved > kill_at, details
    if killed == 1:
        assert (
            f"preempted by another process's signal (process 0 of 2): saved step {saved}" in stopped[0].stderr
        )
    assert f"preempted by SIGTERM (process 1 of 2): saved step {saved}" in stopped[1].stderr, details
    # Each process saved its own position.
    positions = sorted(p.name for p in (tmp_path / str(saved) / "iterators").glob("*.json"))
    assert positions == ["process_0-of-2.json", "process_1-of-2.json"], details

    resumed = _run_job(tmp_path, job)
    details = f"{context}\n{describe_results(resumed)}"
    assert [r.returncode for r in resumed] == [0, 0], details
    for result, states in zip(resumed, source_states, strict=True):
        assert f"resumed at step {saved}: " in result.stdout and states in result.stdout, details
        # The restored parameters and momentum are laid out as saved: split, where they were.
        assert f"holds {rows} and {rows} rows of w" in result.stdout, details
    first, second = _job_losses(stopped), _job_losses(resumed)
    assert sorted(first) == list(range(saved)) and sorted(second) == list(range(saved, total)), details
    assert {**first, **second} == expected, details  # Bit for bit.
    assert _job_params(resumed) == expected_params and expected_params[0], details


# --- a shuffled source, in processes of their own ------------------------------------------

# (strategy, epochs, step after which SIGTERM comes): the save comes at the next step, in pass 2
# (from 0), whose order a counter restarted at 0 does not give: mid-epoch on one device (24
# batches a pass), at the step that starts pass 3 on four (6 batches a pass; pass 2 all taken).
SHUFFLED_STOPS = pytest.mark.parametrize(
    ("strategy", "epochs", "kill_at"),
    [("one-device", 3, 2 * 24 + 5), ("mirrored", 4, 3 * 6 - 1)],
    ids=["one-device, mid-epoch", "mirrored-4, at an epoch boundary"],
)


def _run_worker(directory, *args):
    """The worker as a process of its own, with four CPU devices."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    done = subprocess.run(
        [sys.executable, str(WORKER), str(directory), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    lines = re.findall(r"^loss (\d+) (\S+)$", done.stdout, re.MULTILINE)
    return done, {int(step): loss for step, loss in lines}


@pytest.mark.slow  # Three processes.
@SHUFFLED_STOPS
def test_a_source_shuffled_by_the_restored_pass_number_resumes_bit_for_bit(
    tmp_path, strategy, epochs, kill_at
):
    _stopped_and_resumed_bit_for_bit(
        tmp_path, ["--strategy", strategy, "--epochs", str(epochs), "--shuffle", "seeded"], kill_at
    )


def _stopped_and_resumed_bit_for_bit(tmp_path, args, kill_at):
    """Run the worker through, then again stopped by SIGTERM at `kill_at` and restarted: the two
    runs' losses must be the same, bit for bit. Returns the restarted process."""
    baseline, expected = _run_worker(tmp_path / "baseline", *args)
    assert baseline.returncode == 0, baseline.stderr
    stopped, first = _run_worker(tmp_path / "run", *args, "--kill-at", str(kill_at), "--kill-now")
    assert stopped.returncode == 42, stopped.stderr
    assert checkpoint.Checkpointer(tmp_path / "run").latest_step() == kill_at + 1
    resumed, second = _run_worker(tmp_path / "run", *args)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(second) == list(range(kill_at + 1, len(expected)))
    assert {**first, **second} == expected  # Bit for bit.
    return resumed


@pytest.mark.slow  # Two processes.
@SHUFFLED_STOPS
def test_a_source_shuffled_by_a_counter_that_restarts_fails_to_resume_rather_than_train_on_other_data(
    tmp_path, strategy, epochs, kill_at
):
    # Before, the restarted process skipped through another pass's order and trained on it.
    args = ["--strategy", strategy, "--epochs", str(epochs), "--shuffle", "counter"]
    stopped, first = _run_worker(tmp_path, *args, "--kill-at", str(kill_at), "--kill-now")
    assert stopped.returncode == 42 and sorted(first) == list(range(kill_at + 1)), stopped.stderr
    resumed, second = _run_worker(tmp_path, *args)
    assert resumed.returncode == 1 and second == {}, resumed.stderr
    assert re.search(
        r"ValueError: DistributedIterator.set_state\(\): the dataset's source yields other elements on "
        r"this pass than when the position was saved: .* pass 2 \(from 0\)",
        resumed.stderr,
    ), resumed.stderr


@pytest.mark.slow  # Three processes.
@pytest.mark.parametrize(
    ("strategy", "kill_at"),
    [("one-device", 24 + 9), ("mirrored", 2 * 6 + 3)],
    ids=["one-device, mid-epoch 1", "mirrored-4, mid-epoch 2"],
)
def test_a_grain_pipeline_resumes_bit_for_bit_from_grain_s_own_state(tmp_path, strategy, kill_at):
    # Examples shuffled by Grain anew each epoch, batched, three epochs in one pass read by
    # Grain's threads: no code of the user's own restores the order, Grain's state does.
    pytest.importorskip("grain")
    args = ["--strategy", strategy, "--epochs", "3", "--source", "grain"]
    resumed = _stopped_and_resumed_bit_for_bit(tmp_path, args, kill_at)
    # The position holds Grain's state: the batches taken, none skipped to reach it.
    assert f"'source_states': [{{'json': {{'next_index': {kill_at + 1}}}}}]" in resumed.stdout, resumed.stdout


# --- the handler on its own ------------------------------------------------------------------


@pytest.fixture
def checkpointer(tmp_path):
    with checkpoint.Checkpointer(tmp_path / "checkpoints") as checkpointer:
        yield checkpointer


def test_without_a_signal_the_steps_run_to_the_end_and_nothing_is_saved(checkpointer):
    with checkpoint.PreemptionHandler(checkpointer) as handler:
        assert handler.restore({"w": jnp.zeros(2)})["w"].tolist() == [0.0, 0.0]
        assert list(handler.steps(3, lambda: {"w": jnp.zeros(2)})) == [0, 1, 2]
    assert (handler.step, handler.preempted, checkpointer.latest_step()) == (3, False, None)


def test_a_configured_signal_stops_the_loop_and_a_second_one_does_what_it_did_before(checkpointer):
    handler = checkpoint.PreemptionHandler(
        checkpointer, signals=[signal.SIGUSR1, signal.SIGINT], exit_code=None
    )
    steps = []
    with pytest.raises(KeyboardInterrupt):
        for step in handler.steps(10, lambda: {"w": jnp.full(2, len(steps))}):
            steps.append(step)
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's early notice, say.
                os.kill(os.getpid(), signal.SIGINT)  # Another signal: not yet twice.
                os.kill(os.getpid(), signal.SIGINT)  # The same one again: Python's own handler raises.
    assert steps == [0, 1, 2] and not handler.preempted and checkpointer.latest_step() is None
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


NOTICE_THEN_SIGTERM = """
import os, signal, sys, tempfile, time
import jax.numpy as jnp
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import preemption
preemption._NOTICE_POLL_S = 0.01
handler = checkpoint.PreemptionHandler(
    checkpoint.Checkpointer(tempfile.mkdtemp()), termination_notice=lambda: True, exit_code=None
)
time.sleep(0.2)  # The notice is seen: then the platform's SIGTERM, in the grace period.
os.kill(os.getpid(), signal.SIGTERM)
steps = list(handler.steps(10, lambda: {"w": jnp.zeros(1)}))
print("saved", handler.preempted, steps)
"""

SIGNALS_AFTER_A_LOOP_IN_A_THREAD = """
import os, signal, tempfile, threading
import jax.numpy as jnp
from jaxstrategy import checkpoint
handler = checkpoint.PreemptionHandler(checkpoint.Checkpointer(tempfile.mkdtemp()))
loop = threading.Thread(target=lambda: list(handler.steps(3, lambda: {"w": jnp.zeros(1)})))
loop.start()
loop.join()
handler.close()
print("restored", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
print("the signal was swallowed")
"""


@pytest.mark.slow  # A fresh process.
def test_a_signal_after_a_termination_notice_is_the_first_signal_not_the_second():
    # Before, the notice counted as a first signal: the platform's SIGTERM then ended the process.
    done = subprocess.run(
        [sys.executable, "-c", NOTICE_THEN_SIGTERM], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "saved True []" in done.stdout  # Stopped before its first step, and saved.


@pytest.mark.slow  # A fresh process.
def test_handlers_are_put_back_by_the_main_thread_after_a_loop_in_another():
    # Before, closing in the loop's thread forgot the previous handlers: SIGTERM was swallowed.
    done = subprocess.run(
        [sys.executable, "-c", SIGNALS_AFTER_A_LOOP_IN_A_THREAD], capture_output=True, text=True, timeout=120
    )
    assert "restored True" in done.stdout and "swallowed" not in done.stdout, done.stdout + done.stderr
    assert done.returncode == -signal.SIGTERM


# --- several handlers at once: closed in any order, the signal does what it did before ------


class _Recorder:
    """A signal handler of the program's own, which records the signals it gets."""

    def __init__(self):
        self.received = []

    def __call__(self, signum, frame):
        self.received.append(signum)


@pytest.fixture
def usr1_before():
    """SIGUSR1 as the program had it before any PreemptionHandler: a `_Recorder`."""
    recorder = _Recorder()
    previous = signal.signal(signal.SIGUSR1, recorder)
    yield recorder
    signal.signal(signal.SIGUSR1, previous)


def _usr1_handlers(checkpointer, count):
    return [
        checkpoint.PreemptionHandler(checkpointer, signals=(signal.SIGUSR1,), exit_code=None)
        for _ in range(count)
    ]


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_handlers_closed_in_any_order_give_the_signal_back_to_what_had_it(checkpointer, usr1_before, order):
    # Before, closing the first-made handler first left a closed one installed, which swallowed
    # every later signal: the process neither saved nor did what it did before.
    handlers = _usr1_handlers(checkpointer, 3)
    for index in order:
        handlers[index].close()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert usr1_before.received == [signal.SIGUSR1]
    assert signal.getsignal(signal.SIGUSR1) is usr1_before


@pytest.mark.parametrize("closed", [0, 1, 2], ids=["first closed", "middle closed", "newest closed"])
def test_with_one_handler_closed_the_newest_open_one_still_saves_then_all_give_it_back(
    checkpointer, usr1_before, closed
):
    handlers = _usr1_handlers(checkpointer, 3)
    handlers[closed].close()
    os.kill(os.getpid(), signal.SIGUSR1)  # For the newest handler still open.
    receiver = 1 if closed == 2 else 2
    for index, handler in enumerate(handlers):
        if index != closed:  # Each loop's end closes its handler: in creation order.
            steps = list(handler.steps(3, lambda: {"w": jnp.ones(1)}))
            assert (steps, handler.preempted) == (([], True) if index == receiver else ([0, 1, 2], False))
    assert checkpointer.latest_step() == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    assert usr1_before.received == [signal.SIGUSR1]


TWO_HANDLERS_THEN_SIGTERM = """
import os, signal, sys, tempfile
import jax.numpy as jnp
from jaxstrategy import checkpoint
checkpointer = checkpoint.Checkpointer(tempfile.mkdtemp())
handlers = [checkpoint.PreemptionHandler(checkpointer, exit_code=None) for _ in range(2)]
closed, looping = (0, 1) if sys.argv[1] == "creation order" else (1, 0)
handlers[closed].close()
for step in handlers[looping].steps(10, lambda: {"w": jnp.zeros(1)}):
    if step == 1:
        os.kill(os.getpid(), signal.SIGTERM)
print("saved", handlers[looping].preempted, checkpointer.latest_step(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # Both closed: SIGTERM ends the process, as with none.
print("the signal was swallowed", flush=True)
"""


@pytest.mark.slow  # A fresh process, killed by its SIGTERM.
@pytest.mark.parametrize("order", ["creation order", "reverse order"])
def test_after_two_handlers_closed_in_either_order_sigterm_ends_the_process(order):
    # Before, closing them in creation order left the first one's closed handler installed: the
    # process lived on after SIGTERM.
    done = subprocess.run(
        [sys.executable, "-c", TWO_HANDLERS_THEN_SIGTERM, order], capture_output=True, text=True, timeout=120
    )
    assert "saved True 2" in done.stdout, done.stdout + done.stderr  # The open one still saved.
    assert "swallowed" not in done.stdout and done.returncode == -signal.SIGTERM, done.stdout + done.stderr


def test_exit_code_none_ends_the_loop_and_says_so(checkpointer, caplog):
    handler = checkpoint.PreemptionHandler(checkpointer, exit_code=None)
    with caplog.at_level(logging.WARNING, logger="jaxstrategy"):
        for step in handler.steps(10, lambda: {"w": jnp.full(2, 7.0)}):
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
    assert handler.preempted and handler.step == 2 and checkpointer.latest_step() == 2
    assert "preempted by SIGTERM: saved step 2 to " in caplog.text and "; ending the loop." in caplog.text
    assert checkpointer.restore()["w"].tolist() == [7.0, 7.0]
    with pytest.raises(RuntimeError, match=r"this handler is closed \(its loop ended"):
        next(handler.steps(10, lambda: {}))


def test_a_termination_notice_is_polled(checkpointer, monkeypatch):
    monkeypatch.setattr(preemption, "_NOTICE_POLL_S", 0.01)
    notice = threading.Event()
    handler = checkpoint.PreemptionHandler(checkpointer, termination_notice=notice.is_set)
    with pytest.raises(SystemExit) as exit:
        for step in handler.steps(1000, lambda: {"w": jnp.ones(1)}):
            if step == 3:
                notice.set()
            time.sleep(0.005)
    assert exit.value.code == 42 and handler.preempted and 3 < checkpointer.latest_step() < 1000


def test_a_termination_notice_that_raises_is_polled_again_and_warned_of_once(checkpointer, monkeypatch):
    # Before, the first exception ended the polling thread: the notice was never read again, and
    # the loop ran to its end without a word.
    monkeypatch.setattr(preemption, "_NOTICE_POLL_S", 0.01)
    calls = itertools.count()

    def notice():
        call = next(calls)
        if call < 2:
            raise ConnectionError(f"the metadata server did not answer (call {call})")
        return call >= 5

    handler = checkpoint.PreemptionHandler(checkpointer, termination_notice=notice, exit_code=None)
    with pytest.warns(RuntimeWarning) as warned:
        for _ in handler.steps(1000, lambda: {"w": jnp.ones(1)}):
            time.sleep(0.005)
    assert handler.preempted and checkpointer.latest_step() < 1000
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert re.fullmatch(
        r"PreemptionHandler: termination_notice raised ConnectionError: the metadata server did not "
        r"answer \(call 0\)\. It is called again every 0\.01 s, and stops the loop once it returns True; "
        r"only this first failure is reported\. Catch errors inside termination_notice \(returning False, "
        r"say\) to handle them otherwise\.",
        str(warned[0].message),
    ), warned[0].message
    assert warned[0].filename == __file__  # The loop's line: where the notice's handler runs.


def test_a_step_saved_already_is_not_saved_again(checkpointer, caplog):
    handler = checkpoint.PreemptionHandler(checkpointer, exit_code=None)
    with caplog.at_level(logging.WARNING, logger="jaxstrategy"):
        for step in handler.steps(10, lambda: {"w": jnp.zeros(1)}):
            if step == 1:
                checkpointer.save(2, {"w": jnp.ones(1)})  # As a loop saving each epoch would.
                os.kill(os.getpid(), signal.SIGTERM)
    assert f"step 2 was saved already in {checkpointer.directory}" in caplog.text
    assert checkpointer.restore()["w"].tolist() == [1.0]


def test_bad_arguments_are_clear_errors(checkpointer):
    with pytest.raises(
        TypeError, match=r"checkpointer must be a jaxstrategy.checkpoint.Checkpointer; got str"
    ):
        checkpoint.PreemptionHandler("checkpoints")
    with pytest.raises(
        ValueError, match=r"signals must be signal numbers such as signal.SIGTERM; got 'TERM'"
    ):
        checkpoint.PreemptionHandler(checkpointer, signals="TERM")
    with pytest.raises(ValueError, match=r"cannot handle SIGKILL: \[Errno 22\] Invalid argument"):
        checkpoint.PreemptionHandler(checkpointer, signals=(signal.SIGUSR1, signal.SIGKILL))
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # The one installed was put back.
    with pytest.raises(TypeError, match=r"termination_notice must be a function"):
        checkpoint.PreemptionHandler(checkpointer, termination_notice=True)
    with checkpoint.PreemptionHandler(checkpointer) as handler:
        with pytest.raises(TypeError, match=r"state must be a function returning the tree to save"):
            next(handler.steps(3, {"w": jnp.zeros(1)}))
    errors = []
    thread = threading.Thread(
        target=lambda: _record(errors, lambda: checkpoint.PreemptionHandler(checkpointer))
    )
    thread.start()
    thread.join()
    assert "must be created in the main thread" in str(errors[0])


def _record(errors, fn):
    try:
        fn()
    except Exception as error:
        errors.append(error)


# --- agreeing across processes, against an in-memory coordination service ---------------------


class FakeCoordination:
    """The part of JAX's coordination client the handler uses, in memory; `on_set` reacts to a
    key as the other processes would."""

    def __init__(self, on_set=None, fail=None):
        self.values = {}
        self.changed = threading.Condition()
        self.on_set = on_set or (lambda key, value: None)
        self.fail = fail

    def key_value_set(self, key, value):
        with self.changed:
            if key in self.values:
                raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.changed.notify_all()
        self.on_set(key, value)

    def blocking_key_value_get(self, key, timeout_ms):
        if self.fail is not None:
            raise self.fail
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.values, timeout_ms / 1000):
                raise jax.errors.JaxRuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]


@pytest.fixture
def as_process_1_of_2(monkeypatch):
    """A PreemptionHandler made as in process 1 of a job of 2, whose other process holds none of
    this one's devices (the checkpoints it saves stay this process's alone)."""

    def make(client, checkpointer, **kwargs):
        with monkeypatch.context() as patch:
            patch.setattr(coordination, "coordination_client", lambda: client)
            patch.setattr(jax, "process_index", lambda: 1)
            patch.setattr(jax, "process_count", lambda: 2)
            return checkpoint.PreemptionHandler(checkpointer, **kwargs)

    return make


def test_the_processes_stop_at_the_furthest_step_any_has_started(checkpointer, as_process_1_of_2):
    def other_process(key, value):  # Process 0 is 3 steps further when it hears of the request.
        if key.endswith("/position/1"):
            threading.Timer(0.05, client.key_value_set, (key[: -len("1")] + "0", str(int(value) + 3))).start()

    client = FakeCoordination(on_set=other_process)
    handler = as_process_1_of_2(client, checkpointer, exit_code=None)
    for step in handler.steps(100, lambda: {"w": jnp.full(1, handler.step)}):
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
    # Its signal is seen before step 6; process 0 had started 9 steps: both stop at 9.
    assert handler.preempted and checkpointer.latest_step() == 9
    assert checkpointer.restore()["w"].tolist() == [9.0]
    assert client.values[f"{handler._agreement.namespace}/request"] == "1"


def test_a_process_that_never_answers_is_a_timeout(checkpointer, as_process_1_of_2):
    handler = as_process_1_of_2(FakeCoordination(), checkpointer, timeout_s=0.5)
    with pytest.raises(
        TimeoutError,
        match=r"(?s)process 1 waited 0\.5 s .*agree on the step to stop at.*create the same PreemptionHandlers",
    ):
        for step in handler.steps(100, lambda: {"w": jnp.ones(1)}):
            if step == 1:
                os.kill(os.getpid(), signal.SIGTERM)
    assert checkpointer.latest_step() is None


def test_a_coordination_service_failure_is_raised_at_the_next_step(checkpointer, as_process_1_of_2):
    failing = FakeCoordination(fail=jax.errors.JaxRuntimeError("UNAVAILABLE: the service is gone"))
    handler = as_process_1_of_2(failing, checkpointer)
    with pytest.raises(
        RuntimeError, match=r"watching for preemption failed: UNAVAILABLE: the service is gone"
    ):
        for _ in handler.steps(1000, lambda: {"w": jnp.ones(1)}):
            time.sleep(0.01)
