"""DistributedIterator.get_state / set_state (in checkpoints: tests/checkpoint/test_iterators.py).

A position counts what the user took, never what the input thread read ahead; restoring one makes
the next batch the one after the last taken, by skipping a re-iterable source or through the
get_state/set_state of a source's iterator (Grain's protocol), on every way of laying batches out.
"""

from __future__ import annotations

import json
import re
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import InputOptions, InputReplicationMode, checkpoint
from jaxstrategy._src.input import iterator_state


def _values(batch):
    """A batch's first leaf as a list, whatever the strategy (a PerReplica is stacked)."""
    leaf = batch[0] if isinstance(batch, tuple) else batch
    return np.asarray(getattr(leaf, "stacked", leaf)).reshape(-1).tolist()


class Counted:
    """A re-iterable source that counts the elements read from it, and can end early."""

    def __init__(self, count, *, size=1):
        self.elements = [np.full(size, i, np.int32) for i in range(count)]
        self.reads = 0
        self.limit = count

    def __iter__(self):
        for element in self.elements[: self.limit]:
            self.reads += 1
            yield element


class Stateful:
    """An iterator with Grain's get_state/set_state protocol (its state a dict, or bytes)."""

    def __init__(self, count, *, as_bytes=False):
        self.count, self.index, self.as_bytes = count, 0, as_bytes
        self.reads = 0
        self.states_set = []

    def __iter__(self):
        return self

    def __next__(self):
        if self.index == self.count:
            raise StopIteration
        self.index += 1
        self.reads += 1
        return np.full(2, self.index - 1, np.int32)

    def get_state(self):
        return str(self.index).encode() if self.as_bytes else {"index": self.index}

    def set_state(self, state):
        self.states_set.append(state)
        self.index = int(state) if self.as_bytes else state["index"]


class StatefulSource:
    """A re-iterable source whose passes are `Stateful` iterators."""

    def __init__(self, count, **kwargs):
        self.count, self.kwargs = count, kwargs
        self.passes = []

    def __iter__(self):
        self.passes.append(Stateful(self.count, **self.kwargs))
        return self.passes[-1]


def test_the_position_counts_what_was_taken_not_what_was_prefetched():
    source = Counted(10)
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(source)
    iterator = iter(dataset)
    assert _values(next(iterator)) == [0]
    deadline = time.monotonic() + 10
    while source.reads < 3 and time.monotonic() < deadline:  # The thread reads two more ahead.
        time.sleep(0.01)
    assert source.reads == 3
    assert iterator.get_state() == {
        "pass": 0,
        "batches": 1,
        "elements": [1],
        "source_states": [None],
        "end": False,
        "fingerprints": [iterator_state.fingerprint([np.full(1, 0, np.int32)])],  # Of element 0.
    }
    json.dumps(iterator.get_state())  # Plain JSON.
    restored = iter(dataset)
    restored.set_state(iterator.get_state())
    assert [_values(batch) for batch in restored] == [[i] for i in range(1, 10)]
    assert restored.get_state()["end"] and restored.get_state()["batches"] == 10


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ("split", [[4, 5, 6, 7], [8, 9, 10, 11]]),
        ("consecutive", [[8, 9, 10, 11], [12, 13, 0, 0]]),
        ("per-replica", [[2, 2, 2, 2], [3, 3, 3, 0]]),
    ],
)
def test_every_layout_resumes_at_the_batch_after_the_last_taken(layout, expected):
    strategy = jaxstrategy.MirroredStrategy()  # Four replicas.
    options = InputOptions(partial_batch="pad")
    if layout == "split":
        dataset = strategy.experimental_distribute_dataset(
            [np.arange(i, i + 4) for i in range(0, 12, 4)], options
        )
    elif layout == "consecutive":
        dataset = strategy.distribute_datasets_from_function(lambda context: Counted(14, size=1), options)
    else:
        options = InputOptions(
            partial_batch="pad", experimental_replication_mode=InputReplicationMode.PER_REPLICA
        )
        dataset = strategy.distribute_datasets_from_function(
            lambda context: Counted(3 + (context.input_pipeline_id < 3)), options
        )
    iterator = iter(dataset)
    taken = [next(iterator) for _ in range(1 if layout == "split" else 2)]
    state = iterator.get_state()
    elements = {"split": [1], "consecutive": [8], "per-replica": [2, 2, 2, 2]}[layout]
    assert state["elements"] == elements and state["batches"] == len(taken)
    restored = iter(dataset)
    restored.set_state(state)
    assert [_values(batch) for batch in restored] == expected
    assert restored.get_state()["end"]


def test_dropped_batches_count_as_taken(recwarn):
    strategy = jaxstrategy.MirroredStrategy()
    batches = [np.arange(4), np.arange(3), np.arange(8, 12)]
    dataset = strategy.experimental_distribute_dataset(batches, InputOptions(partial_batch="drop"))
    iterator = iter(dataset)
    next(iterator)
    with pytest.warns(UserWarning, match="dropped a batch of 3 examples"):
        next(iterator)
    assert iterator.get_state()["elements"] == [3] and iterator.get_state()["batches"] == 2


def test_a_source_with_its_own_state_is_restored_from_it_without_reading():
    source = StatefulSource(6)
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(source)
    iterator = iter(dataset)
    next(iterator), next(iterator)
    state = iterator.get_state()
    # The source's state after the second element, though its iterator had read further.
    assert state["source_states"] == [{"json": {"index": 2}}] and state["elements"] == [2]
    restored = iter(dataset)
    restored.set_state(state)
    assert source.passes[-1].states_set == [{"index": 2}]
    assert [_values(batch) for batch in restored] == [[i, i] for i in range(2, 6)]
    assert source.passes[-1].reads == 4  # Nothing was read to skip.


def test_a_source_state_of_bytes_survives_a_checkpoint(tmp_path):
    source = StatefulSource(5, as_bytes=True)
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(source)
    iterator = iter(dataset)
    next(iterator)
    checkpoint.save(tmp_path, {"w": jnp.ones(1), "data": iterator})
    saved = checkpoint.restore(tmp_path)["data"]
    assert saved["source_states"] == [{"bytes": "MQ=="}]  # b"1", base64.
    restored = iter(dataset)
    checkpoint.restore(tmp_path, target={"w": jnp.zeros(1), "data": restored})
    assert source.passes[-1].states_set == [b"1"]
    assert _values(next(restored)) == [1, 1]


def test_a_one_shot_iterator_with_its_own_state_can_be_restored():
    shared = Stateful(5)
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(shared)
    iterator = iter(dataset)
    next(iterator), next(iterator)
    state = iterator.get_state()
    iterator.set_state(state)  # The same iterator, after the input thread is done with it.
    assert [_values(batch) for batch in iterator] == [[2, 2], [3, 3], [4, 4]]


def test_a_one_shot_generator_cannot_be_saved_and_says_so(tmp_path):
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(np.ones(1) for _ in range(3))
    iterator = iter(dataset)
    next(iterator)
    with pytest.raises(TypeError, match=r"^DistributedIterator\.get_state\(\): .* one-shot iterator") as err:
        iterator.get_state()
    assert "(generator)" in str(err.value)
    assert "Distribute a re-iterable source" in str(err.value)
    with pytest.raises(TypeError, match=r"one-shot iterator \(generator\)"):
        checkpoint.save(tmp_path, {"w": jnp.ones(1), "data": iterator})
    with pytest.raises(TypeError, match=r"^DistributedIterator\.set_state\(\): .*one-shot"):
        iterator.set_state({})


def test_a_long_skip_warns(monkeypatch):
    monkeypatch.setattr(iterator_state, "SLOW_SKIP_S", 0.0)
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(Counted(5))
    iterator = iter(dataset)
    next(iterator), next(iterator)
    restored = iter(dataset)
    with pytest.warns(UserWarning, match=r"read and dropped 2 elements of its source\(s\) .* get_state"):
        restored.set_state(iterator.get_state())
    assert _values(next(restored)) == [2]


def test_the_end_of_a_pass_and_its_number_are_kept():
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(Counted(2))
    first = iter(dataset)
    assert len(list(first)) == 2
    second = iter(dataset)
    next(second)
    second.close()  # Closing is not the end of the pass.
    assert second.get_state() == {
        **first.get_state(),
        "pass": 1,
        "batches": 1,
        "elements": [1],
        "end": False,
        "fingerprints": [iterator_state.fingerprint([np.full(1, 0, np.int32)])],
    }
    restored = iter(dataset)  # Pass 2 ...
    restored.set_state(first.get_state())  # ... now pass 0, over.
    assert list(restored) == [] and restored.get_state() == first.get_state()
    assert iter(dataset).get_state()["pass"] == 1  # Passes go on from the restored one.


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        ([1], TypeError, r"expected the dict that DistributedIterator.get_state\(\) returns, with the keys"),
        (
            {"pass": -1, "batches": True, "elements": [1.5], "source_states": [None], "end": 1},
            ValueError,
            r"malformed iterator state: pass=-1 is not an int >= 0; batches=True is not an int >= 0; "
            r"end=1 is not a bool; elements=\[1.5\] is not a list of ints >= 0\.",
        ),
        (
            {"pass": 0, "batches": 1, "elements": [1, 1], "source_states": [None, None], "end": False},
            ValueError,
            r"the state is of a pass over 2 input pipeline\(s\), but this dataset reads 1",
        ),
        (
            {"pass": 0, "batches": 9, "elements": [9], "source_states": [None], "end": False},
            ValueError,
            r"the dataset's source ended after 3 elements, but the state says 9 were taken",
        ),
        (
            {"pass": 0, "batches": 1, "elements": [1], "source_states": [{"json": 1}], "end": False},
            ValueError,
            r"the state was saved from a source whose iterator has get_state\(\) and set_state\(\), but "
            r"the iterator of the dataset's source is a generator without them",
        ),
    ],
    ids=["not a dict", "malformed", "other pipelines", "source too short", "state without protocol"],
)
def test_a_bad_state_is_a_clear_error(state, error, message):
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(Counted(3))
    with pytest.raises(error, match=rf"DistributedIterator.set_state\(\): {message}"):
        iter(dataset).set_state(state)


class NumpyState(Stateful):
    """Counts in a numpy integer, which JSON cannot hold."""

    def get_state(self):
        return {"index": np.int64(self.index)}


class Opaque(Stateful):
    def get_state(self):
        return {1j}


def test_a_state_that_is_not_json_is_read_and_refused_only_when_saved(tmp_path):
    # Before, every element's state was encoded as it was read, so the first next() failed.
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(NumpyState(3))
    iterator = iter(dataset)
    assert _values(next(iterator)) == [0, 0]
    # The leaf that JSON cannot hold, its type, and the fix.
    leaf = r"\(NumpyState\) returned a state .*: state\['index'\] is a numpy int64\."
    with pytest.raises(TypeError, match=r"^DistributedIterator\.get_state\(\): .*" + leaf) as err:
        iterator.get_state()
    assert "(int(x) for a numpy integer)" in str(err.value)
    with pytest.raises(TypeError, match=leaf):
        checkpoint.save(tmp_path, {"w": jnp.ones(1), "data": iterator})
    assert [_values(batch) for batch in iterator] == [[1, 1], [2, 2]]


def test_a_state_that_is_not_json_names_its_pipeline_and_its_type():
    strategy = jaxstrategy.MirroredStrategy()  # Four replicas.
    options = InputOptions(experimental_replication_mode=InputReplicationMode.PER_REPLICA)
    dataset = strategy.distribute_datasets_from_function(
        lambda context: Opaque(2) if context.input_pipeline_id == 2 else Stateful(2), options
    )
    iterator = iter(dataset)
    next(iterator)
    with pytest.raises(TypeError, match=r"iterator of input pipeline 2 \(Opaque\) returned a state") as err:
        iterator.get_state()
    assert "neither bytes nor JSON, so this position cannot be saved: state is a set." in str(err.value)


def _circular():
    loop = []
    loop.append(loop)
    return {"loop": loop}


def _shared_then_bad():
    shared = [1, 2]  # Twice, not within itself: JSON takes it.
    return {"a": shared, "b": shared, "c": np.int32(7)}


@pytest.mark.parametrize(
    ("state", "problem"),
    [
        ({"index": np.int64(3)}, "state['index'] is a numpy int64"),
        ({"seen": [1, 2, np.bool_(True)]}, "state['seen'][2] is a numpy bool"),
        ({(1, 2): 3}, "state has the key (1, 2), a tuple"),
        ({"at": object()}, "state['at'] is an object"),
        (_circular(), "state['loop'][0] contains itself"),
        (_shared_then_bad(), "state['c'] is a numpy int32"),
    ],
    ids=["numpy int", "nested numpy bool", "tuple key", "object", "circular", "shared twice"],
)
def test_what_json_cannot_hold_is_named_by_its_path(state, problem):
    assert iterator_state.encode_source_state(state, Stateful(1)) == iterator_state.UnsavableState(
        "Stateful", problem
    )


def test_where_no_part_is_found_json_s_own_error_is_given(monkeypatch):
    monkeypatch.setattr(iterator_state, "_unencodable_part", lambda value, path, seen: None)
    unsavable = iterator_state.encode_source_state({1j}, Stateful(1))
    assert unsavable.problem == "state is a set (Object of type set is not JSON serializable)"


def test_threads_sharing_an_iterator_count_each_batch_once():
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(Counted(200))
    iterator = iter(dataset)
    taken = []
    threads = [
        threading.Thread(target=lambda: taken.extend(next(iterator) for _ in range(25))) for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(taken) == 100 and iterator.get_state()["elements"] == [100]


# --- a shuffled source's resume is checked --------------------------------------------------


class EpochShuffled:
    """Global batches of 4 rows, each pass in the order of `epoch`, which the loop sets: from the
    pass number the restored iterator is in, after a restart (the right habit)."""

    def __init__(self, count=6):
        self.elements = [np.full((4, 2), i, np.int32) for i in range(count)]
        self.epoch = 0

    def __iter__(self):
        order = np.random.default_rng(self.epoch).permutation(len(self.elements))
        return (self.elements[i] for i in order)


class CounterShuffled(EpochShuffled):
    """Shuffled by a counter each `__iter__` bumps, which restarts at 0 in a new process."""

    def __iter__(self):
        pass_ = super().__iter__()
        self.epoch += 1
        return pass_


STRATEGIES = pytest.mark.parametrize(
    "make_strategy",
    [jaxstrategy.OneDeviceStrategy, jaxstrategy.MirroredStrategy],
    ids=["one-device", "mirrored-4"],
)
# Where pass 2 is saved: after 4 of its 6 batches; after all 6 (a save at the epoch boundary);
# after the end was seen too (a save after `for batch in iterator`).
WHERE = pytest.mark.parametrize("taken", [4, 6, "end"], ids=["mid-epoch", "all taken", "ended"])


def _uninterrupted(strategy):
    source = EpochShuffled()
    dataset = strategy.experimental_distribute_dataset(source)
    passes = []
    for epoch in range(4):
        source.epoch = epoch
        passes.append([_values(batch) for batch in dataset])
    return passes


def _saved_in_pass_2(source_type, strategy, taken):
    """The state of pass 2 (from 0) once `taken` of its batches were taken, in a first run."""
    source = source_type()
    dataset = strategy.experimental_distribute_dataset(source)
    for epoch in range(3):
        if source_type is EpochShuffled:
            source.epoch = epoch
        iterator = iter(dataset)
        if epoch < 2:
            list(iterator)
    for _ in iterator if taken == "end" else range(taken):
        next(iterator, None)
    return iterator.get_state()


@STRATEGIES
@WHERE
def test_a_source_seeded_by_the_pass_number_resumes_on_the_batches_it_stopped_at(make_strategy, taken):
    strategy = make_strategy()
    expected = _uninterrupted(strategy)
    assert expected[2] != expected[1]  # Each pass in its own order.
    state = _saved_in_pass_2(EpochShuffled, strategy, taken)
    source = EpochShuffled()  # The restart: a new source, seeded by the pass the state is in.
    source.epoch = state["pass"]
    dataset = strategy.experimental_distribute_dataset(source)
    iterator = iter(dataset)
    iterator.set_state(state)
    rest = [_values(batch) for batch in iterator]
    source.epoch = 3
    assert rest + [_values(batch) for batch in dataset] == expected[2][4 if taken == 4 else 6 :] + expected[3]


@STRATEGIES
@WHERE
def test_a_source_shuffled_by_a_counter_that_restarts_at_0_is_an_error_not_other_data(make_strategy, taken):
    # Before, the restart skipped through pass 1's order (the counter's, in the new process) and
    # trained on other batches than the uninterrupted run, without a word.
    strategy = make_strategy()
    state = _saved_in_pass_2(CounterShuffled, strategy, taken)
    iterator = iter(strategy.experimental_distribute_dataset(CounterShuffled()))
    with pytest.raises(ValueError, match=r"yields other elements on this pass than when the position") as err:
        iterator.set_state(state)
    message = str(err.value)
    assert re.search(r"its element (3|5) \(from 0\), the last taken before the save", message)
    assert "The saved position is in pass 2 (from 0)" in message
    assert "by that pass number, set before restoring" in message


@STRATEGIES
def test_a_position_saved_before_fingerprints_restores_unchecked(make_strategy):
    strategy = make_strategy()
    state = _saved_in_pass_2(CounterShuffled, strategy, 3)
    del state["fingerprints"]
    iterator = iter(strategy.experimental_distribute_dataset(CounterShuffled()))
    iterator.set_state(state)  # As before: no check, and no warning (warnings are errors here).
    assert len(list(iterator)) == 3


def test_a_fingerprint_sums_dtype_shape_and_bytes_and_only_the_ends_of_a_large_leaf():
    fingerprint = iterator_state.fingerprint
    x = np.arange(6, dtype=np.int32)
    others = [x + 1, x.reshape(2, 3), x.view(np.float32), x.astype(np.int64)]
    assert len({fingerprint([x]), *(fingerprint([y]) for y in others)}) == 5
    assert fingerprint([x, x]) != fingerprint([x])
    assert fingerprint([jnp.asarray(x)]) == fingerprint([jnp.asarray(x + 1)])  # Not read back.
    large = np.zeros(iterator_state._SUMMED_BYTES, np.int32)  # 4 bytes each: twice the limit and more.
    middle = large.copy()
    middle[len(large) // 2] = 1
    ends = large.copy()
    ends[-1] = 1
    assert fingerprint([middle]) == fingerprint([large]) != fingerprint([ends])
