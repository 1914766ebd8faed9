"""The step format: a checkpoint saved by an earlier jaxstrategy restores, and plain orbax reads ours.

`fixtures/saved_before_the_house_move/` was written by jaxstrategy 0.1.0 at commit bff294c,
before `jaxstrategy/_src` was split into subpackages (its README says how): its orbax metadata
names the handlers of the `checksums` and `iterators` items by their module paths then.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxstrategy
from jaxstrategy import checkpoint
from jaxstrategy._src.checkpoint import checksums
from jaxstrategy._src.checkpoint import format as checkpoint_format

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "saved_before_the_house_move"
# What the fixture's script saved at step 7, and the batches its iterator read from.
BATCHES = [np.full((2, 3), i, np.float32) for i in range(5)]


def _saved_arrays():
    return {
        "params": {
            "dense": {
                "kernel": jnp.arange(12, dtype=jnp.float32).reshape(3, 4) / 8,
                "bias": jnp.array([0.5, -1.5, 2.25, 3.0], jnp.float32),
            }
        },
        "opt": {"count": jnp.array(7, jnp.int32), "empty": jnp.zeros((0, 5), jnp.bfloat16)},
        "rng": jax.random.key(42),
    }


@pytest.fixture
def saved_before(tmp_path: Path) -> Path:
    """A copy of the fixture, since restoring may write beside it (a lock file)."""
    return Path(shutil.copytree(FIXTURE, tmp_path / "checkpoint"))


def _assert_same_arrays(restored, expected):
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(expected), strict=True
    ):
        if jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(got) == jax.random.key_impl(want), path
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert got.dtype == want.dtype and got.shape == want.shape, path
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes(), path


def test_a_checkpoint_saved_before_the_move_restores_leaf_for_leaf_with_its_position(saved_before):
    strategy = jaxstrategy.MirroredStrategy(["/cpu:0", "/cpu:1"])
    iterator = iter(strategy.experimental_distribute_dataset(BATCHES))
    restored = checkpoint.restore(
        saved_before, strategy=strategy, target={**_saved_arrays(), "data": iterator}
    )
    assert restored.pop("data") is iterator
    _assert_same_arrays(restored, _saved_arrays())
    jaxstrategy.testing.assert_tree_on_strategy(restored, strategy)
    # It had taken two batches: the third comes next.
    (part, _) = strategy.experimental_local_results(next(iterator))
    assert np.asarray(part).tolist() == [[2.0] * 3]


def test_a_checkpoint_saved_before_the_move_restores_without_a_target(saved_before):
    restored = checkpoint.restore(saved_before, strategy=jaxstrategy.OneDeviceStrategy("/cpu:1"))
    assert restored.pop("data") == {
        "pass": 0,
        "batches": 2,
        "elements": [2],
        "source_states": [None],
        "end": False,
    }
    _assert_same_arrays(restored, _saved_arrays())


def _handlers_named_in(step_directory: Path) -> dict[str, str]:
    return json.loads((step_directory / "_CHECKPOINT_METADATA").read_text())["item_handlers"]


def test_steps_name_jaxstrategy_handlers_by_fixed_strings_not_module_paths(tmp_path):
    strategy = jaxstrategy.OneDeviceStrategy()
    iterator = iter(strategy.experimental_distribute_dataset(BATCHES))
    next(iterator)
    checkpoint.save(tmp_path, {"w": jnp.ones(3), "data": iterator}, step=0)
    named = _handlers_named_in(tmp_path / "0")
    assert named["checksums"] == "jaxstrategy.checkpoint.ChecksumHandler"
    assert named["iterators"] == "jaxstrategy.checkpoint.IteratorStatesHandler"
    assert not any(name.startswith("jaxstrategy._src") for name in named.values())


def test_plain_orbax_restores_every_item_of_a_new_step_and_of_one_saved_before(tmp_path, saved_before):
    strategy = jaxstrategy.OneDeviceStrategy()
    iterator = iter(strategy.experimental_distribute_dataset(BATCHES))
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0), "data": iterator}, step=4)
    for directory, step in [(tmp_path, 4), (saved_before, 7)]:
        with ocp.CheckpointManager(directory) as manager:
            items = manager.restore(step)
        assert set(items) == {
            "state",
            "prng_keys",
            "checksums",
            "iterators",
            *(["zero_size_shapes"] * (step == 7)),
        }
        # Every file of the item, by name: one per process, or 0.1's one file of whole leaves.
        (name, checksums), *others = items["checksums"].items()
        assert not others
        assert (name, checksums["algorithm"]) == (
            ("checksums.json", "crc32 of 4 KiB block sums")
            if step == 7
            else ("process_0-of-1.json", "crc32c")
        )
        assert set(items["iterators"]) == {"data"}


def test_the_format_names_the_items_and_their_former_handler_names():
    assert checkpoint_format.REQUIRED_ITEMS == ("state", "prng_keys")
    assert (
        _handlers_named_in(FIXTURE / "7")["checksums"]
        in checkpoint_format.FORMER_TYPESTRS[checkpoint_format.CHECKSUM_HANDLER_TYPESTR]
    )
    assert (
        _handlers_named_in(FIXTURE / "7")["iterators"]
        in checkpoint_format.FORMER_TYPESTRS[checkpoint_format.ITERATOR_STATES_HANDLER_TYPESTR]
    )


# --- format numbers ----------------------------------------------------------------------------


def _custom_metadata(step_directory: Path) -> dict:
    return json.loads((step_directory / "_CHECKPOINT_METADATA").read_text())["custom_metadata"]


def _set_format(step_directory: Path, number) -> None:
    path = step_directory / "_CHECKPOINT_METADATA"
    metadata = json.loads(path.read_text())
    if number is None:
        del metadata["custom_metadata"]["jaxstrategy_format"]
    else:
        metadata["custom_metadata"]["jaxstrategy_format"] = number
    path.write_text(json.dumps(metadata))


@pytest.mark.parametrize("with_checksums", [True, False], ids=["checksummed", "unchecksummed"])
def test_every_step_saved_records_its_format_number(tmp_path, monkeypatch, with_checksums):
    monkeypatch.setattr(checksums, "write_checksums", with_checksums)
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, {"w": jnp.ones(2)})  # In the background.
        checkpointer.wait()
    recorded = _custom_metadata(tmp_path / "3")
    assert recorded["jaxstrategy_format"] == checkpoint_format.NEWEST_FORMAT == 2
    assert ("jaxstrategy_checksums" in recorded) == with_checksums


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "unverified"])
def test_a_step_of_a_newer_format_is_refused_saying_to_upgrade(tmp_path, verify):
    checkpoint.save(tmp_path, {"w": jnp.ones(2)})
    _set_format(tmp_path / "0", 99)
    with pytest.raises(checkpoint.CorruptCheckpointError) as excinfo:
        checkpoint.restore(tmp_path, verify=verify)
    message = str(excinfo.value)
    assert f"step 0 in {tmp_path}" in message
    assert "checkpoint format 99" in message and "formats up to 2" in message
    assert "Upgrade jaxstrategy" in message


@pytest.mark.parametrize("number", ["2", 0, True, 2.0], ids=["a string", "zero", "a bool", "a float"])
def test_a_format_number_that_is_no_number_is_a_corrupt_step(tmp_path, number):
    checkpoint.save(tmp_path, {"w": jnp.ones(2)})
    _set_format(tmp_path / "0", number)
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=rf"(?s)step 0 .*format number.* is {number!r}, not an int"
    ):
        checkpoint.restore(tmp_path)


@pytest.mark.parametrize("number", [None, 1, 2], ids=["no number", "format 1", "format 2"])
def test_a_step_of_a_known_format_or_of_none_restores_checked_by_what_it_holds(tmp_path, number):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    _set_format(tmp_path / "0", number)
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0]
    # Still checked as format 2, by its CRC32C files: a wrong checksum is caught.
    sums = tmp_path / "0" / "checksums" / "process_0-of-1.json"
    content = json.loads(sums.read_text())
    content["leaves"]["w"]["0:3"] ^= 1
    sums.write_text(json.dumps(content))
    with pytest.raises(checkpoint.CorruptCheckpointError, match=r"\n  w: crc32c 0x"):
        checkpoint.restore(tmp_path)


def test_the_fixture_of_format_1_has_no_format_number_and_restores(saved_before):
    assert "jaxstrategy_format" not in _custom_metadata(saved_before / "7")
    restored = checkpoint.restore(saved_before)
    assert restored.pop("data")["batches"] == 2
    _assert_same_arrays(restored, _saved_arrays())
