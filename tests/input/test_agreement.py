"""Where processes' inputs end: the per-step agreement, with the other processes simulated.

The key-value protocol itself runs in real two-process jobs in test_multi_worker.py; here a fake
agreement stands for the other process, so every outcome is checked quickly.
"""

from __future__ import annotations

import re
import threading

import jax
import pytest

from jaxstrategy._src.input import agreement as agreement_module
from jaxstrategy._src.input.agreement import StepAgreement, agreed_steps
from jaxstrategy._src.input.replica_batches import DroppedBatch

CALLER = "Strategy.distribute_datasets_from_function()"


class OtherProcessHas:
    """Two processes; the other one has a batch for its first `steps` steps."""

    num_processes = 2

    def __init__(self, steps: int):
        self.steps = steps
        self.asked: list[tuple[int, bool]] = []

    def count(self, step: int, signature: str | None) -> int:
        has_batch = signature is not None
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
        def count(self, step, signature):
            return None

    assert list(agreed_steps(iter(["a"]), Gone(5), cardinality=-2, caller=CALLER)) == []


class FakeCoordinationService:
    """The key-value calls StepAgreement makes, as JAX's coordination service answers them."""

    def __init__(self):
        self.store: dict[str, str] = {}
        self.changed = threading.Condition()

    def key_value_increment(self, key, increment):
        with self.changed:
            value = int(self.store.get(key, "0")) + increment
            self.store[key] = str(value)
            self.changed.notify_all()
            return value

    def key_value_set(self, key, value):
        with self.changed:
            self.store[key] = value
            self.changed.notify_all()

    def key_value_dir_get(self, directory):
        return [(key, value) for key, value in self.store.items() if key.startswith(directory)]

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.changed:
            if not self.changed.wait_for(lambda: key in self.store, timeout=timeout_in_ms / 1000):
                raise jax.errors.JaxRuntimeError(
                    f"DEADLINE_EXCEEDED: GetKeyValue() timed out with key: {key}"
                )
            return self.store[key]

    def key_value_try_get(self, key):
        return self.store[key]

    def key_value_delete(self, key):
        with self.changed:  # As the service does: the key and every key under it.
            for stored in [k for k in self.store if k == key or k.startswith(f"{key}/")]:
                del self.store[stored]


def agreement(service, *, stop=None, timeout_s=30.0, n=2, process_id=0):
    return StepAgreement(
        "ns",
        stop=stop or threading.Event(),
        caller=CALLER,
        timeout_s=timeout_s,
        client=service,
        num_processes=n,
        process_id=process_id,
    )


def test_two_processes_agree_step_by_step_and_clean_up_after_themselves():
    service = FakeCoordinationService()
    first, second = agreement(service), agreement(service, process_id=1)
    has = {
        first: ["f32[2]", "f32[2]", "f32[2]"],
        second: ["f32[2]", "f32[2]", None],
    }  # The second ends first.
    counts: dict[object, list] = {first: [], second: []}

    def take_part(side):
        for step, signature in enumerate(has[side]):
            counts[side].append(side.count(step, signature))

    other = threading.Thread(target=take_part, args=(second,))
    other.start()
    take_part(first)
    other.join(timeout=30)
    assert counts[first] == counts[second] == [2, 2, 1]
    assert service.store == {}  # Every step's keys deleted once both had read them.


@pytest.fixture
def polling_fast(monkeypatch):
    """Waits polled every 0.1 s instead of every second: the tests below wait out a poll."""
    monkeypatch.setattr(agreement_module, "_POLL_MS", 100)


def test_closing_the_iterator_ends_a_wait(polling_fast):
    stop = threading.Event()
    alone = agreement(FakeCoordinationService(), stop=stop)
    threading.Timer(0.2, stop.set).start()
    assert alone.count(0, "f32[2]") is None


def test_waiting_past_the_timeout_names_the_step_and_how_many_arrived(polling_fast):
    alone = agreement(FakeCoordinationService(), timeout_s=0.5)
    with pytest.raises(
        TimeoutError,
        match=rf"{re.escape(CALLER)}: process 0 waited 0 s .* step 4 of this dataset's pass, and only 1 of 2 did",
    ):
        alone.count(4, "f32[2]")


def test_other_coordination_errors_are_raised():
    class Broken(FakeCoordinationService):
        def blocking_key_value_get(self, key, timeout_in_ms):
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: the coordinator went away")

    with pytest.raises(jax.errors.JaxRuntimeError, match="UNAVAILABLE"):
        agreement(Broken()).count(0, "f32[2]")


def test_batches_that_do_not_fit_together_are_an_error_on_every_process():
    # Two processes whose second batches differ in shape: assembled, they would make a global
    # array of memory nobody wrote. Both raise, naming what each has.
    service = FakeCoordinationService()
    sides = [agreement(service, process_id=0), agreement(service, process_id=1)]
    signatures = [["f32[4, 2]", "f32[4, 2]"], ["f32[4, 2]", "f32[3, 2]"]]
    errors: list[BaseException] = []

    def take_part(side, mine):
        try:
            for step, signature in enumerate(mine):
                assert side.count(step, signature) == 2
        except ValueError as error:
            errors.append(error)

    other = threading.Thread(target=take_part, args=(sides[1], signatures[1]))
    other.start()
    take_part(sides[0], signatures[0])
    other.join(timeout=30)
    assert len(errors) == 2
    for error in errors:
        assert str(error).startswith(
            f"{CALLER}: at step 1 of this pass, the processes' batches differ in structure, shape "
            "or dtype, so they cannot make one global batch"
        )
        assert "\n  process 0: f32[4, 2]\n  process 1: f32[3, 2]\nGive every process" in str(error)
