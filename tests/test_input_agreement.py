"""Where processes' inputs end: the per-step agreement, with the other processes simulated.

The key-value protocol itself runs in real two-process jobs in test_multi_worker.py; here a fake
agreement stands for the other process, so every outcome is checked quickly.
"""

from __future__ import annotations

from jaxstrategy._src.input_agreement import agreed_steps
from jaxstrategy._src.replica_batches import DroppedBatch

CALLER = "Strategy.distribute_datasets_from_function()"


class OtherProcessHas:
    """Two processes; the other one has a batch for its first `steps` steps."""

    num_processes = 2

    def __init__(self, steps: int):
        self.steps = steps
        self.asked: list[tuple[int, bool]] = []

    def count(self, step: int, has_batch: bool) -> int:
        self.asked.append((step, has_batch))
        return int(has_batch) + int(step < self.steps)


def run(batches: list, other_steps: int, cardinality: int = -2) -> tuple[list, OtherProcessHas]:
    agreement = OtherProcessHas(other_steps)
    return list(agreed_steps(iter(batches), agreement, cardinality=cardinality, caller=CALLER)), agreement


def test_equal_inputs_end_together_without_a_warning():
    items, agreement = run(["a", "b"], other_steps=2)
    assert items == ["a", "b"]
    assert agreement.asked == [(0, True), (1, True), (2, False)]


def test_a_longer_input_stops_where_the_other_ended_and_counts_what_it_leaves():
    items, _ = run(["a", "b", "c", "d"], other_steps=2, cardinality=4)
    assert items[:2] == ["a", "b"]
    (warning,) = items[2:]
    assert isinstance(warning, DroppedBatch)
    assert warning.message.startswith(
        f"{CALLER}: the input of 1 of 2 processes ended at step 2 while the others"
    )
    assert "this process leaves 2 batch(es) unread" in warning.message


def test_an_unknown_length_leaves_at_least_one_batch():
    items, _ = run(["a", "b", "c"], other_steps=1)
    assert items[0] == "a" and "this process leaves at least one batch unread" in items[1].message


def test_a_shorter_input_warns_that_it_is_one_that_ended():
    items, _ = run(["a"], other_steps=3)
    assert items[0] == "a"
    assert "this process's input is one of those that ended" in items[1].message


def test_dropped_batches_pass_through_without_a_step_of_their_own():
    dropped = DroppedBatch("dropped")
    items, agreement = run(["a", dropped, "b"], other_steps=2)
    assert items == ["a", dropped, "b"]
    assert agreement.asked == [(0, True), (1, True), (2, False)]


def test_a_consumer_that_went_away_ends_the_pass_quietly():
    class Gone(OtherProcessHas):
        def count(self, step, has_batch):
            return None

    assert list(agreed_steps(iter(["a"]), Gone(5), cardinality=-2, caller=CALLER)) == []
