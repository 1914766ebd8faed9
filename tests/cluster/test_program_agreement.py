"""The check that every process runs the same step programs, with the processes simulated.

A real two-process job whose processes diverge is in
tests/strategies/test_multi_worker_agreements.py.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstrategy._src.cluster.program_agreement import ProgramAgreement, jaxpr_fingerprint

CALLER = "MultiWorkerMirroredStrategy.run()"


class Store:
    """The key-value part of JAX's coordination client, in memory, as the check uses it."""

    def __init__(self):
        self.values: dict[str, str] = {}
        self.calls = 0

    def key_value_set(self, key, value):
        self.calls += 1
        if key in self.values:
            raise jax.errors.JaxRuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.values[key] = value

    def key_value_try_get(self, key):
        self.calls += 1
        if key not in self.values:
            raise jax.errors.JaxRuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.values[key]

    def key_value_increment(self, key, amount):
        self.calls += 1
        self.values[key] = str(int(self.values.get(key, "0")) + amount)
        return int(self.values[key])

    def key_value_dir_get(self, directory):
        self.calls += 1
        return [(key, value) for key, value in self.values.items() if key.startswith(directory)]

    def key_value_delete(self, key):
        self.calls += 1
        self.values = {k: v for k, v in self.values.items() if not (k == key or k.startswith(f"{key}/"))}


def train_step(x):
    return x + 1


def other_step(x):
    return x * 2


def posted_round(store, round_index=0, process=0):
    """What `process` posted for a round, as `[name, calls in a row]` pairs: in a job of two whose
    process 1 never posts, process 0's posts stay in the store."""
    return json.loads(store.values[f"programs/{round_index}/round/{process}"])


def processes(n=2, calls_per_round=4):
    store = Store()
    checks = [
        ProgramAgreement(
            caller=CALLER,
            client=store,
            num_processes=n,
            process_id=p,
            calls_per_round=calls_per_round,
            namespace="programs",
        )
        for p in range(n)
    ]
    return store, checks


def test_processes_running_the_same_programs_go_on_and_leave_one_round_of_keys_at_most():
    store, checks = processes()
    for call in range(40):
        for check in checks:
            check.record(train_step if call % 3 else other_step)
            check.settle()
    assert store.values == {}  # Every round's keys deleted by the last to arrive.
    # 10 rounds of 2 processes: a post, a count and a look for a verdict each, and the last
    # one's read and delete: 8 calls a round, none between rounds.
    assert store.calls == 10 * 8


def test_a_process_branching_at_call_3_stops_both_within_the_bound_naming_both_programs():
    _, (first, second) = processes()
    raised_at: dict[int, tuple[int, str]] = {}
    for call in range(20):
        for process, check in enumerate((first, second)):
            if process in raised_at:
                continue
            try:
                check.record(other_step if process == 1 and call >= 3 else train_step)
            except RuntimeError as error:
                raised_at[process] = (call, str(error))
            check.settle()  # As if the round trip were instant.
    # Call 3 is in the second round (calls 3 to 6, closed by call 7): the last to arrive there
    # (process 1) finds it, and raises at its next call; process 0 reads it at its next round,
    # 4 calls later.
    assert raised_at[1][0] == 8 and raised_at[0][0] == 12
    for _, message in raised_at.values():
        assert message.startswith(
            f"{CALLER}: at run call 3, process 0 ran test_program_agreement.train_step (code "
        )
        assert re.search(
            r"and process 1 ran test_program_agreement.other_step \(code [0-9a-f]{8}\)\. ", message
        )
        assert "look for a branch on jax.process_index() around or inside the step" in message
    with pytest.raises(RuntimeError, match="at run call 3"):  # And at every later call.
        first.record(train_step)
    for check in (first, second):
        check.close()


def test_a_round_is_compared_in_a_thread_so_that_no_call_waits_for_the_service():
    class Slow(Store):
        def key_value_increment(self, key, amount):
            time.sleep(0.5)
            return super().key_value_increment(key, amount)

    store = Slow()
    check = ProgramAgreement(caller=CALLER, client=store, num_processes=1, process_id=0, calls_per_round=2)
    started = time.perf_counter()
    for _ in range(4):
        check.record(train_step)
    assert time.perf_counter() - started < 0.25
    check.settle()
    assert store.values == {}
    check.close()


def test_a_traced_program_is_named_by_its_jaxpr_and_traced_once():
    store, (check, _) = processes()
    traces = []

    def make_step(scale):
        def step(x):
            traces.append(scale)
            return x * scale

        return step

    results, steps = {}, []
    for scale in (2.0, 2.0, 3.0):
        steps.append(step := make_step(scale))  # Alive: a collected function's name is forgotten.
        results[scale] = jax.jit(check.fingerprinting(step, step))(jnp.ones(2)).tolist()
    assert traces == [2.0, 2.0, 3.0]  # Fingerprinting traced each once.
    assert results == {2.0: [2.0, 2.0], 3.0: [3.0, 3.0]}
    for step in [*steps, train_step]:  # The fourth call closes the round of the first three.
        check.record(step)
    check.settle()
    # The same code with the same closure is one program (two calls in a row); another constant,
    # another one.
    (first, first_calls), (second, second_calls) = posted_round(store)
    assert (first_calls, second_calls) == (2, 1) and first != second
    for name in (first, second):
        assert re.fullmatch(r"test_program_agreement.*step \(program [0-9a-f]{8}\)", name)
    check.close()


def test_a_function_s_name_is_forgotten_with_it_as_its_id_may_name_another_later():
    # Before, a function collected and another made at its address (on one process and not the
    # other) took the first one's name, and the processes' rounds differed.
    _, (check,) = processes(n=1, calls_per_round=1 << 30)
    step = eval("lambda x: x + 1")  # noqa: S307  # A function of its own, not held by the module.
    check.record(step)
    check.record(train_step)  # Names the previous call's function.
    assert len(check._names) == 1
    del step
    gc.collect()
    assert check._names == {}


def test_fingerprints_ignore_memory_addresses():
    assert jaxpr_fingerprint("f at 0x7f3a2b") == jaxpr_fingerprint("f at 0x55e1c0")
    assert jaxpr_fingerprint("mul a 2.0") != jaxpr_fingerprint("mul a 3.0")


def test_a_call_between_rounds_costs_well_under_a_microsecond():
    _, (check,) = processes(n=1, calls_per_round=1 << 30)
    calls = 100_000
    started = time.perf_counter()
    for _ in range(calls):
        check.record(train_step)
    per_call_us = (time.perf_counter() - started) / calls * 1e6
    assert per_call_us < 5, per_call_us  # About 0.3 µs here; generous for a loaded machine.


def test_arguments_that_are_not_arrays_reach_the_program_as_they_are():
    _, (check,) = processes(n=1)

    def step(x, mode):
        return x * (2.0 if mode == "double" else 1.0)

    fingerprinted = jax.jit(check.fingerprinting(step, step), static_argnames="mode")
    assert fingerprinted(jnp.ones(2), mode="double").tolist() == [2.0, 2.0]
    assert fingerprinted(jnp.ones(2), mode="keep").tolist() == [1.0, 1.0]


def test_a_check_nobody_holds_ends_its_thread():
    threads_before = set(threading.enumerate())
    check = ProgramAgreement(caller=CALLER, client=Store(), num_processes=1, process_id=0, calls_per_round=4)
    for _ in range(8):
        check.record(train_step)
    check.settle()
    (thread,) = [
        thread
        for thread in set(threading.enumerate()) - threads_before
        if thread.name == "jaxstrategy-programs"
    ]
    del check
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_closure_s_array_values_change_the_fingerprint():
    def closing_over(values):
        return lambda x: x + values

    def fingerprint(values):
        return jaxpr_fingerprint(jax.jit(closing_over(values)).trace(jnp.ones(4)).jaxpr)

    assert fingerprint(np.full(4, 1.0, np.float32)) == fingerprint(np.full(4, 1.0, np.float32))
    assert fingerprint(np.full(4, 1.0, np.float32)) != fingerprint(np.full(4, 2.0, np.float32))


def test_a_code_fingerprint_is_the_same_whatever_each_process_s_string_hashing():
    # A set literal is a frozenset constant, whose order follows PYTHONHASHSEED.
    script = (
        "from jaxstrategy._src.cluster.program_agreement import _code_fingerprint\n"
        "def step(x, mode='train'):\n"
        "    return x if mode in {'train', 'finetune', 'warmup', 'eval'} else -x\n"
        "print(_code_fingerprint(step))\n"
    )
    # The three processes run at once: each spends its time importing JAX.
    children = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2", "3")
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    assert [child.returncode for child in children] == [0, 0, 0], [err for _, err in outputs]
    prints = {out.strip() for out, _ in outputs}
    assert len(prints) == 1, prints


def test_a_step_made_of_the_caller_s_function_names_that_function():
    store, (check, _) = processes()

    class StepOfObjects:  # What `run` makes of a function called with NNX objects.
        def __init__(self, user_function):
            self.program_of = lambda: user_function

        def __call__(self, x):
            return x + 1

    step = StepOfObjects(train_step)
    jax.jit(check.fingerprinting(step, step))(jnp.ones(2))
    for _ in range(4):
        check.record(train_step)
    check.settle()
    ((name, _),) = posted_round(store)
    assert re.fullmatch(r".*train_step \(program [0-9a-f]{8}\)", name)
    check.close()


def test_rounds_close_at_calls_4_8_16_32_64_then_every_64_so_short_jobs_are_compared():
    store, (check, _) = processes(calls_per_round=64)
    closed = []
    for call in range(1, 200):
        check.record(train_step)
        check.settle()
        if f"programs/{len(closed)}/round/0" in store.values:  # The round just closed was posted.
            closed.append(call)
    assert closed == [4, 8, 16, 32, 64, 128, 192]
    check.close()


def test_a_branch_at_call_3_is_found_in_a_job_of_a_dozen_calls():
    _, (first, second) = processes(calls_per_round=64)
    raised_at = {}
    for call in range(12):
        for process, check in enumerate((first, second)):
            if process in raised_at:
                continue
            try:
                check.record(other_step if process == 1 and call >= 3 else train_step)
            except RuntimeError:
                raised_at[process] = call
            check.settle()
    # Call 3 is in the round of calls 3 to 6, closed by the eighth call: the last to arrive there
    # (process 1) raises at its next call. Process 0 would read the verdict at its next round
    # (the 16th call); in a job, process 1's error ends it sooner (cluster/job_exits.py).
    assert raised_at == {1: 8}
