"""Iterators in checkpoints: each process's position saved beside the arrays, restored in place.

How a position is counted and restored is tested in tests/input/test_iterator_state.py.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint.iterators import IteratorStatesHandler

_SIX = [np.full(1, i, np.int32) for i in range(6)]


def test_a_checkpoint_restores_an_iterator_in_place_or_gives_its_state(tmp_path):
    strategy = jaxstrategy.OneDeviceStrategy()
    dataset = strategy.experimental_distribute_dataset(_SIX)
    iterator = iter(dataset)
    next(iterator), next(iterator), next(iterator)
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, {"params": {"w": jnp.ones(2)}, "data": [iterator]})
        next(iterator)  # Saving took the position at once; the background write does not see this.
        checkpointer.wait()
        without_target = checkpointer.restore()
        assert without_target["data"][0]["elements"] == [3]
        fresh = iter(dataset)
        restored = checkpointer.restore(target={"params": {"w": jnp.zeros(2)}, "data": [fresh]})
    assert restored["data"][0] is fresh and restored["params"]["w"].tolist() == [1.0, 1.0]
    assert [np.asarray(batch).tolist() for batch in fresh] == [[3], [4], [5]]


def test_a_target_and_a_checkpoint_that_disagree_on_iterators_restore_nothing(tmp_path):
    dataset = jaxstrategy.OneDeviceStrategy().experimental_distribute_dataset(_SIX)
    iterator = iter(dataset)
    next(iterator)
    checkpoint.save(tmp_path / "with", {"w": jnp.ones(1), "data": iterator})
    checkpoint.save(tmp_path / "without", {"w": jnp.ones(1), "data": None})
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=r"does not match the checkpoint .*\n  data: the target holds a DistributedIterator, the checkpoint no iterator position",
    ):
        checkpoint.restore(tmp_path / "without", target={"w": jnp.ones(1), "data": iter(dataset)})
    target = iter(dataset)
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=r"\n  data: the checkpoint holds an iterator position, the target no DistributedIterator",
    ):
        checkpoint.restore(tmp_path / "with", target={"w": jnp.ones(1), "data": None})
    assert target.get_state()["elements"] == [0]  # Nothing was restored.


def test_positions_restore_only_in_a_job_of_as_many_processes(tmp_path):
    # Even positions that were the same on every process: a job of another size splits its
    # input otherwise, so they would resume on other batches.
    handler = IteratorStatesHandler()
    same = json.dumps({"data": {"elements": [4]}})
    for process in range(2):
        (tmp_path / f"process_{process}-of-2.json").write_text(same)
    with pytest.raises(
        ValueError,
        match=r"saved by a job of 2 processes, and this job has 1: .* Restore them in a job of 2 processes$",
    ):
        handler.restore(tmp_path)
    (tmp_path / "process_0-of-1.json").write_text(json.dumps({"data": {"elements": [5]}}))
    assert handler.restore(tmp_path) == {"data": {"elements": [5]}}
