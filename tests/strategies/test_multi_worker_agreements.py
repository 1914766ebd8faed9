"""What the processes of a real job agree on, and what that costs: jobs of two processes.

The protocols' every outcome is tested quickly against an in-memory store in
tests/input/test_agreement.py and tests/cluster/test_program_agreement.py; here they run
through JAX's coordination service, with one CPU device per process. Jobs of 4 and 8 processes
run in bench/multi_worker.py.
"""

from __future__ import annotations

import json
import re

import pytest

from jaxstrategy._src.cluster.local_workers import describe_results
from jaxstrategy._src.cluster.program_agreement import CALLS_PER_ROUND
from jaxstrategy.testing import run_local_workers

pytestmark = pytest.mark.slow  # Each test starts a job.
TIMEOUT_S = 180

COUNTING_PROGRAM = """
import json, numpy as np, jaxstrategy
from jaxstrategy._src.cluster import coordination
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)
counts = coordination.count_operations()
step = lambda x: jaxstrategy.get_replica_context().all_reduce("sum", x.sum())

def one_pass(steps, with_len=True):
    def dataset_fn(context):
        batches = [np.ones(2, np.float32)] * steps
        return batches if with_len else (b for b in batches)
    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    before = counts.total("input")
    for batch in (dataset if with_len else dataset):
        strategy.run(step, args=(batch,))
    return counts.total("input") - before

found = {"short": one_pass(4), "long": one_pass(40)}
before = counts.total("programs")
for _ in range(2 * %(calls)d):
    strategy.run(step, args=(np.ones(1, np.float32),))
found["programs"] = counts.total("programs") - before
print("COUNTS", json.dumps(found), flush=True)
"""


def test_a_pass_over_sources_with_a_length_costs_the_same_few_calls_whatever_its_length():
    program = COUNTING_PROGRAM % {"calls": CALLS_PER_ROUND}
    results = run_local_workers(["-c", program], devices_per_worker=1, timeout=TIMEOUT_S)
    described = describe_results(results)
    assert [result.returncode for result in results] == [0, 0], described
    counts = [json.loads(re.search(r"COUNTS (.*)", r.stdout).group(1)) for r in results]  # type: ignore[union-attr]
    total = {kind: sum(found[kind] for found in counts) for kind in ("short", "long", "programs")}
    # 0 calls per step: a pass of 40 steps costs what one of 4 does. 7N + 3 calls: at its first
    # and last steps a write and a count per process, a wait for all but the last to arrive, whose
    # directory read and result make two; then a count per process and one delete.
    assert total["short"] == total["long"] == 7 * 2 + 3, described
    # Two rounds of the program check: 3 calls per process each, and the last to arrive 2 more.
    assert total["programs"] == 2 * (3 * 2 + 2), described


DIVERGING_PROGRAM = """
import jax, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)

def train_step(x):
    return jaxstrategy.get_replica_context().all_reduce("sum", x)

def other_step(x):  # The same collective: nothing in XLA tells the two apart.
    return jaxstrategy.get_replica_context().all_reduce("sum", x * 2.0)

for step in range(1000):
    fn = other_step if step >= 3 and jax.process_index() == 1 else train_step
    print(step, float(strategy.run(fn, args=(1.0,))), flush=True)
"""


def test_a_process_that_runs_another_program_from_step_3_stops_every_process_naming_both():
    # Before, both ran all 1000 steps, summing 1 + 2 = 3.0 from step 3 on, without an error.
    results = run_local_workers(["-c", DIVERGING_PROGRAM], devices_per_worker=1, timeout=TIMEOUT_S)
    described = describe_results(results)
    assert [result.returncode for result in results] == [1, 1], described
    for result in results:
        assert re.search(
            r"at run call 3, process 0 ran train_step \(program [0-9a-f]{8}\) and process 1 ran "
            r"other_step \(program [0-9a-f]{8}\)",
            result.stderr,
        ), described
        steps = [
            int(line.split()[0]) for line in result.stdout.splitlines() if re.fullmatch(r"\d+ \S+", line)
        ]
        # Within the stated bound: every process stops within 2 rounds of the call that differed,
        # and the calls made during a round trip to the coordinator.
        assert 3 <= max(steps) < 3 + 2 * CALLS_PER_ROUND + 16, described


LYING_LENGTH_PROGRAM = """
import sys, jax, numpy as np, jaxstrategy
strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=10)
step = lambda x: jaxstrategy.get_replica_context().all_reduce("sum", x.sum())

class Lying:
    '''Yields `yields` batches and says it has `says`.'''
    def __init__(self, says, yields):
        self.says, self.yields = says, yields
    def __len__(self):
        return self.says
    def __iter__(self):
        return iter([np.ones(2, np.float32)] * self.yields)

def one_pass(says, yields):
    me = jax.process_index()
    source = Lying(says, yields) if me == 1 else Lying(says, says)
    dataset = strategy.distribute_datasets_from_function(lambda context: source)
    steps = 0
    for batch in dataset:
        float(strategy.run(step, args=(batch,)))
        steps += 1
    return steps

try:
    one_pass(says=4, yields=6)  # Longer than it says: every process raises at its last step.
    print("no error", flush=True)
except ValueError as error:
    print("LONGER", error, flush=True)
one_pass(says=6, yields=3)  # Shorter: process 1 raises at step 3, and no process hangs.
print("no error", flush=True)
"""


def test_a_len_that_is_wrong_is_an_error_on_every_process_never_a_hang():
    results = run_local_workers(["-c", LYING_LENGTH_PROGRAM], devices_per_worker=1, timeout=TIMEOUT_S)
    described = describe_results(results)
    for result in results:
        assert (
            "LONGER MultiWorkerMirroredStrategy.distribute_datasets_from_function(): at step 3 of this "
            "pass, the input of process 1 says it has 4 batch(es) (its source's len()), but it yields "
            "more than 4." in result.stdout
        ), described
        assert "no error" not in result.stdout, described
        assert result.returncode == 1, described
        assert (
            "the input of process 1 says it has 6 batch(es) (its source's len()), but it yields only 3"
            in (result.stderr)
        ), described
