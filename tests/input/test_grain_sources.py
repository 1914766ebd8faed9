"""Real Grain pipelines as the sources of distributed datasets: a position taken k batches into
a shuffled, repeated pass is saved as Grain's own iterator state and restored through Grain's
`set_state`, so the batches after it are the uninterrupted pass's, bit for bit, on one device and
on MirroredStrategy over four (in a SIGTERM'd process: tests/checkpoint/test_preemption.py).

Three kinds of pipeline: a `MapDataset` shuffled, mapped, repeated and batched, then made an
`IterDataset` read in order; the same read by Grain's threads, with an `IterDataset` map and batch
after them (its threads read ahead of what the user takes); and a `DataLoader`, whose state is
bytes. Skipped where Grain is not installed (it is in the `test` extra).
"""

from __future__ import annotations

import base64
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import checkpoint

grain = pytest.importorskip("grain")

NUM_EXAMPLES = 36
NUM_EPOCHS = 2
BATCH_SIZE = 8  # 72 examples in 9 batches: batch 4 holds the end of epoch 0 and the start of 1.
NUM_BATCHES = NUM_EXAMPLES * NUM_EPOCHS // BATCH_SIZE


def _examples():
    return np.random.default_rng(0).standard_normal((NUM_EXAMPLES, 3)).astype(np.float32)


def _augment(row):
    return {"x": row * 2.0, "norm": np.float32(np.linalg.norm(row))}


def _map_dataset():
    return (
        grain.MapDataset.source(_examples())
        .shuffle(seed=7)
        .map(_augment)
        .repeat(NUM_EPOCHS)  # Reshuffled each epoch (reseed_each_epoch).
        .batch(BATCH_SIZE)
    )


def _pipeline(kind):
    if kind == "map-dataset":
        # num_threads=0: read in the caller's thread (the default is 16 threads).
        return _map_dataset().to_iter_dataset(grain.ReadOptions(num_threads=0))
    if kind == "iter-dataset-threads":
        # Four threads read ahead of what the user takes (up to 16 elements), then an
        # IterDataset's own map and batch.
        read_options = grain.ReadOptions(num_threads=4, prefetch_buffer_size=16)
        examples = grain.MapDataset.source(_examples()).shuffle(seed=7).repeat(NUM_EPOCHS)
        return examples.to_iter_dataset(read_options=read_options).map(_augment).batch(BATCH_SIZE)
    assert kind == "data-loader", kind
    sampler = grain.samplers.IndexSampler(NUM_EXAMPLES, shuffle=True, num_epochs=NUM_EPOCHS, seed=7)
    return grain.DataLoader(
        data_source=_examples(),
        sampler=sampler,
        operations=[grain.transforms.Batch(BATCH_SIZE)],
        worker_count=0,
    )


PIPELINES = pytest.mark.parametrize("kind", ["map-dataset", "iter-dataset-threads", "data-loader"])
STRATEGIES = pytest.mark.parametrize(
    "make_strategy",
    [jaxstrategy.OneDeviceStrategy, jaxstrategy.MirroredStrategy],
    ids=["one-device", "mirrored-4"],
)


def _host(batch):
    """A batch's leaves as (dtype, shape, bytes): equal only if equal bit for bit. A PerReplica's
    stacked replicas are the global batch, in order."""
    leaves = jax.tree.leaves(jax.tree.map(lambda leaf: getattr(leaf, "stacked", leaf), batch))
    return [(np.asarray(leaf).dtype.str, np.shape(leaf), np.asarray(leaf).tobytes()) for leaf in leaves]


def _uninterrupted(dataset):
    batches = [_host(batch) for batch in iter(dataset)]
    # The examples' rows (the last leaf: `x`, or the DataLoader's array), in the order taken.
    rows = np.concatenate([np.frombuffer(data, dtype) for dtype, _, data in (b[-1] for b in batches)])
    epoch_0, epoch_1 = rows.reshape(NUM_EPOCHS, NUM_EXAMPLES, 3)
    # Each epoch all the examples, epoch 1 in an order of its own.
    assert not np.array_equal(epoch_0, epoch_1)
    np.testing.assert_array_equal(epoch_0[np.lexsort(epoch_0.T)], epoch_1[np.lexsort(epoch_1.T)])
    return batches


def _grain_state_after(kind, taken):
    """What `get_state()` gives of Grain's own iterator of the pipeline after `taken` elements."""
    iterator = iter(_pipeline(kind))
    for _ in range(taken):
        next(iterator)
    return iterator.get_state()


def _decoded(saved):
    """A source state as a position holds it (JSON, bytes as base64), as get_state() gave it."""
    ((tag, value),) = saved.items()
    return base64.b64decode(value) if tag == "bytes" else value


@PIPELINES
@STRATEGIES
@pytest.mark.parametrize("taken", [1, 4, 5, 8], ids=lambda k: f"{k} taken")
def test_a_grain_pipeline_resumes_on_the_batches_it_stopped_at_bit_for_bit(kind, make_strategy, taken):
    dataset = make_strategy().experimental_distribute_dataset(_pipeline(kind))
    expected = _uninterrupted(dataset)
    assert len(expected) == NUM_BATCHES
    iterator = iter(dataset)
    head = [_host(next(iterator)) for _ in range(taken)]
    state = iterator.get_state()
    assert state["fingerprints"] == [None]  # Restored from Grain's state, not by skipping.
    restored = iter(dataset)
    restored.set_state(state)
    assert head + [_host(batch) for batch in restored] == expected
    assert restored.get_state()["end"]


@PIPELINES
@STRATEGIES
def test_a_grain_pipeline_resumes_through_a_checkpoint(tmp_path, kind, make_strategy):
    strategy = make_strategy()
    dataset = strategy.experimental_distribute_dataset(_pipeline(kind))
    expected = _uninterrupted(dataset)
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    checkpoint.save(tmp_path, {"w": jnp.ones(2), "data": iterator})
    del iterator  # As a new process would, from a new iterator.
    restored = iter(dataset)
    tree = checkpoint.restore(tmp_path, target={"w": jnp.zeros(2), "data": restored})
    assert tree["data"] is restored  # Repositioned in place.
    assert [_host(batch) for batch in restored] == expected[3:]


@PIPELINES
def test_the_position_holds_grain_s_own_state_of_the_batches_taken(tmp_path, kind):
    # Four replicas, and for the threaded pipeline threads reading ahead: the state is still
    # that of the batches taken, as Grain's own iterator gives it after as many.
    iterator = iter(jaxstrategy.MirroredStrategy().experimental_distribute_dataset(_pipeline(kind)))
    for _ in range(3):
        next(iterator)
    grain_state = _grain_state_after(kind, 3)
    if kind == "data-loader":
        # Bytes (JSON inside): 3 batches of 8 examples seen, the last of them index 23.
        assert json.loads(grain_state)["last_seen_indices"] == {"0": 23}
    else:
        # Batched before Grain reads (3 batches), or after (24 examples, read ahead by threads).
        assert grain_state == {"next_index": 3 if kind == "map-dataset" else 24}
    (state,) = iterator.get_state()["source_states"]
    assert _decoded(state) == grain_state and iterator.get_state()["elements"] == [3]
    checkpoint.save(tmp_path, {"w": jnp.ones(2), "data": iterator})
    # On disk: the step's `iterators` item, one JSON file per process, by the iterator's path.
    (saved,) = json.loads((tmp_path / "0" / "iterators" / "process_0-of-1.json").read_text()).values()
    assert [_decoded(state) for state in saved["source_states"]] == [grain_state]
    (restored,) = checkpoint.restore(tmp_path)["data"]["source_states"]
    assert _decoded(restored) == grain_state
