"""Restoring: a target checked leaf by leaf, unreadable steps, and checkpoints written by orbax alone."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from checkpoint_support import assert_bit_exact, largest_file

from jaxstrategy import checkpoint


def test_a_mismatched_target_names_every_differing_leaf_and_restores_nothing(tmp_path):
    checkpoint.save(
        tmp_path, {"w": jnp.ones((2, 3)), "b": jnp.zeros(3), "old": jnp.ones(1), "k": jax.random.key(0)}
    )
    target = {
        "w": jnp.ones((3, 2)),
        "b": jnp.zeros(3, jnp.int32),
        "new": jnp.ones(1),
        "k": jnp.zeros(2, jnp.uint32),
    }
    with pytest.raises(checkpoint.CheckpointMismatchError) as info:
        checkpoint.restore(tmp_path, target=target)
    message = str(info.value)
    assert message.startswith(
        f"The target does not match the checkpoint at step 0 in {tmp_path}; nothing was restored:"
    )
    for line in (
        "new: in the target, not in the checkpoint",
        "old: in the checkpoint (float32[1]), not in the target",
        "b: the checkpoint has float32[3], the target int32[3]",
        "w: the checkpoint has float32[2, 3], the target float32[3, 2]",
    ):
        assert f"\n  {line}" in message
    assert isinstance(info.value, ValueError)


def test_python_numbers_save_as_jax_would_type_them(tmp_path):
    checkpoint.save(tmp_path, {"step": 3, "rate": 0.5})
    for target in ({"step": 0, "rate": 0.0}, {"step": jnp.asarray(0), "rate": jnp.asarray(0.0)}):
        restored = checkpoint.restore(tmp_path, target=target)
        assert (restored["step"].tolist(), restored["step"].dtype) == (3, jnp.int32)
        assert (restored["rate"].tolist(), restored["rate"].dtype) == (0.5, jnp.float32)


def test_a_target_leaf_that_is_not_an_array_is_reported_once(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    with pytest.raises(checkpoint.CheckpointMismatchError) as info:
        checkpoint.restore(tmp_path, target={"w": "weights"})
    assert str(info.value).endswith(
        "nothing was restored:\n  w: the target leaf is a str, not an array or ShapeDtypeStruct"
    )


def test_a_target_expecting_keys_where_plain_arrays_were_saved(tmp_path):
    checkpoint.save(tmp_path, {"k": jnp.zeros(2, jnp.uint32)})
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=r"k: the target holds PRNG keys, the checkpoint plain uint32\[2\]",
    ):
        checkpoint.restore(tmp_path, target={"k": jax.random.key(0)})


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(100_000, dtype=jnp.float32)})
    data = largest_file(tmp_path / "0" / "state")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=rf"Cannot read the checkpoint at step 0 in {tmp_path}"
    ):
        checkpoint.restore(tmp_path)


def test_a_step_written_by_something_else_is_a_clear_error(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    for path in sorted((tmp_path / "0").rglob("*"), reverse=True):
        if path.is_file() and path.name != "commit_success.txt":
            path.write_bytes(b"garbage")
    with pytest.raises(
        checkpoint.CorruptCheckpointError, match=rf"Cannot read the checkpoint at step 0 in {tmp_path}"
    ):
        checkpoint.restore(tmp_path)


# --- atomicity ---------------------------------------------------------------------------------


def test_a_checkpoint_of_orbax_standard_checkpointer_restores(tmp_path, strategy_cpu1):
    import orbax.checkpoint as ocp

    tree = {"w": jnp.arange(6.0).reshape(2, 3), "layers": [jnp.int32(3)]}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "plain", tree)
    restored = checkpoint.restore(tmp_path / "plain", strategy=strategy_cpu1)
    assert_bit_exact(restored, tree)
    assert restored["w"].devices() == {strategy_cpu1.device} and restored["w"].committed
    assert_bit_exact(checkpoint.restore(tmp_path / "plain", target=tree), tree)
    with pytest.raises(
        checkpoint.CheckpointNotFoundError,
        match=rf"(?s){re.escape(str(tmp_path / 'plain'))} is a single checkpoint .*StandardCheckpointer.*"
        r"no step 3\. Restore it with step=None",
    ):
        checkpoint.restore(tmp_path / "plain", step=3)
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=rf"checkpoint at {tmp_path / 'plain'} \(written by orbax alone\); nothing was restored",
    ):
        checkpoint.restore(tmp_path / "plain", target={"w": jnp.ones(2)})


def test_a_checkpoint_of_an_orbax_checkpoint_manager_restores(tmp_path):
    import orbax.checkpoint as ocp

    with ocp.CheckpointManager(tmp_path) as manager:
        for step in (1, 2):
            manager.save(step, args=ocp.args.StandardSave({"w": jnp.full(2, float(step))}))
    assert checkpoint.restore(tmp_path)["w"].tolist() == [2.0, 2.0]
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.restore(1)["w"].tolist() == [1.0, 1.0]
    with pytest.raises(
        checkpoint.CheckpointNotFoundError,
        match=rf"(?s)No checkpoint for step 5 in {re.escape(str(tmp_path))}, .*CheckpointManager.*"
        r"it holds steps \[1, 2\]",
    ):
        checkpoint.restore(tmp_path, step=5)


# --- checksums ---------------------------------------------------------------------------------
