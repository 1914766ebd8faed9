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
    process_id = 0
    lengths = None  # Its sources have no len(): it agrees step by step.

    def __init__(self, steps: int):
        self.steps = steps
        self.asked: list[tuple[int, bool]] = []

    def count(self, step: int, signature: str | None, length: int = -1) -> int:
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
        def count(self, step, signature, length=-1):
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
        if key not in self.store:
            raise jax.errors.JaxRuntimeError(f"NOT_FOUND: Config key {key} not found.")
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


# --- sources with a len(): agreed once per pass --------------------------------------------------


class CountingService(FakeCoordinationService):
    """The fake service, counting every call made to it."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        for name in ("key_value_increment", "key_value_set", "key_value_dir_get", "key_value_try_get"):
            setattr(self, name, self._counted(getattr(self, name)))
        self.blocking_key_value_get = self._counted(self.blocking_key_value_get)
        self.key_value_delete = self._counted(self.key_value_delete)

    def _counted(self, method):
        def call(*args, **kwargs):
            with self.changed:
                self.calls += 1
            return method(*args, **kwargs)

        return call


@pytest.fixture
def shapes_before_hash(monkeypatch):
    """Batches are strings here; what a batch's signature is: the part before '#'."""
    monkeypatch.setattr(agreement_module, "batch_signature", lambda item: item.partition("#")[0])


def take_part_in_pass(inputs, lengths, service=None, timeout_s=30.0):
    """Each process's outcome of one pass over `inputs[p]`, whose source says it has `lengths[p]`
    batches: the items it handed out, or its error, with what it handed out before."""
    service = service or FakeCoordinationService()
    outcomes: list = [None] * len(inputs)

    def process(p):
        handed_out = []
        side = agreement(service, n=len(inputs), process_id=p, timeout_s=timeout_s)
        try:
            for item in agreed_steps(iter(inputs[p]), side, cardinality=lengths[p], caller=CALLER):
                handed_out.append(item)
            outcomes[p] = handed_out
        except (ValueError, TimeoutError) as error:
            outcomes[p] = (error, handed_out)

    threads = [threading.Thread(target=process, args=(p,)) for p in range(len(inputs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a process hung"
    return outcomes


def batches(n, shape="f32[2]"):
    return [f"{shape}#{i}" for i in range(n)]


@pytest.mark.parametrize("steps", [1, 2, 5, 50])
def test_sources_with_a_length_agree_a_fixed_number_of_times_per_pass(shapes_before_hash, steps):
    service = CountingService()
    outcomes = take_part_in_pass([batches(steps)] * 3, [steps] * 3, service)
    assert outcomes == [batches(steps)] * 3
    # Step 0 and the last step, whatever the pass's length: 3 processes, 24 calls in all (two
    # rounds of a write and an increment each, a wait for all but the last to arrive, whose
    # directory read and result make 10; and the end's 3 counts and a delete); step by step it
    # would be 8 per step more.
    assert service.calls == 24
    assert service.store == {}


def test_without_a_length_every_step_is_agreed(shapes_before_hash):
    service = CountingService()
    assert take_part_in_pass([batches(5)] * 2, [-2, -2], service) == [batches(5)] * 2
    assert service.calls > 5 * 2 * 3


def test_a_source_with_a_length_beside_one_without_agrees_step_by_step(shapes_before_hash):
    service = CountingService()
    assert take_part_in_pass([batches(5)] * 2, [5, -2], service) == [batches(5)] * 2
    assert service.calls > 5 * 2 * 3


def test_lengths_that_differ_end_every_process_at_the_shortest_with_the_warning(shapes_before_hash):
    shorter, longer = take_part_in_pass([batches(3), batches(5)], [3, 5])
    assert shorter[:3] == longer[:3] == batches(3)
    for items, here in (
        (shorter, "this process's input is one of those that ended"),
        (longer, "this process leaves 2 batch(es) unread"),
    ):  # noqa: E501
        (warning,) = items[3:]
        assert isinstance(warning, DroppedBatch)
        assert warning.message.startswith(
            f"{CALLER}: the input of 1 of 2 processes ended at step 3 while the others"
        )
        assert here in warning.message


def test_a_short_last_batch_on_one_process_is_an_error_on_every_process_at_that_step(shapes_before_hash):
    outcomes = take_part_in_pass([batches(3), [*batches(2), "f32[1]#2"]], [3, 3])
    for error, handed_out in outcomes:
        assert handed_out == batches(2)
        assert str(error).startswith(
            f"{CALLER}: at step 2 of this pass, the processes' batches differ in structure, shape or dtype"
        )
        assert "\n  process 0: f32[2]\n  process 1: f32[1]\nGive every process" in str(error)


def test_short_last_batches_alike_on_every_process_are_a_step(shapes_before_hash):
    last = [*batches(2), "f32[1]#2"]
    assert take_part_in_pass([last, last], [3, 3]) == [last, last]


def test_a_len_longer_than_the_source_is_an_error_on_every_process_by_the_pass_s_end(
    shapes_before_hash, polling_fast
):
    # Process 1 says 6 and yields 2: it raises where it runs out; process 0, at the last step.
    (error_0, handed_0), (error_1, handed_1) = take_part_in_pass([batches(6), batches(2)], [6, 6])
    message = (
        f"{CALLER}: at step 2 of this pass, the input of process 1 says it has 6 batch(es) (its "
        "source's len()), but it yields only 2. The processes agree"
    )
    assert str(error_0).startswith(message) and str(error_1).startswith(message)
    assert "Make the source's __len__ return the number of elements its __iter__ yields" in str(error_0)
    assert handed_1 == batches(2)
    assert handed_0[:2] == batches(2)


def test_a_len_shorter_than_the_source_is_an_error_on_every_process_at_the_last_step(shapes_before_hash):
    outcomes = take_part_in_pass([batches(3), batches(5)], [3, 3])
    for error, handed_out in outcomes:
        assert handed_out == batches(2)
        assert str(error).startswith(
            f"{CALLER}: at step 2 of this pass, the input of process 1 says it has 3 batch(es) (its "
            "source's len()), but it yields more than 3."
        )


def test_a_source_that_runs_out_at_the_last_step_is_an_error_on_every_process(shapes_before_hash):
    for error, handed_out in take_part_in_pass([batches(3), batches(2)], [3, 3]):
        assert handed_out == batches(2)
        assert (
            "the input of process 1 says it has 3 batch(es) (its source's len()), but it yields only 2"
            in str(error)
        )


def test_a_batch_unlike_the_first_in_the_middle_of_a_pass_is_an_error_on_every_process(
    shapes_before_hash, polling_fast
):
    odd = [*batches(2), "f32[7]#2", *batches(2)]
    (error_0, _), (error_1, handed_1) = take_part_in_pass([batches(5), odd], [5, 5])
    assert handed_1 == batches(2)
    message = f"{CALLER}: at step 2 of this pass, process 1's batch is f32[7], but the pass's first"
    assert str(error_0).startswith(message) and str(error_1).startswith(message)
    assert "alike on every process, was f32[2]." in str(error_1)
    assert "a source without a len(), whose batches the processes compare step by step" in str(error_1)


def test_a_process_that_never_reaches_the_last_step_times_out_naming_it(polling_fast):
    service = FakeCoordinationService()
    alone = agreement(service, timeout_s=0.3)
    alone.lengths = [3, 3]
    with pytest.raises(TimeoutError, match=r"to reach step 2 of this dataset's pass, and only 1 of 2 did"):
        alone.last_step(2, "f32[2]", has_more=False)


def test_a_source_that_says_it_has_no_batches_but_yields_one_is_an_error_on_every_process(shapes_before_hash):
    for error, handed_out in take_part_in_pass([batches(2), batches(2)], [0, 2]):
        assert handed_out == []
        assert str(error).startswith(
            f"{CALLER}: at step 0 of this pass, the input of process 0 says it has 0 batch(es) (its "
            "source's len()), but it yields some."
        )
