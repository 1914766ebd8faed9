"""Checkpointing: bit-exact round trips onto any strategy, atomic saves, and clear errors."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstrategy
from jaxstrategy import OneDeviceStrategy, checkpoint
from jaxstrategy.testing import run_local_workers


def _tree():
    key = jax.random.key(7)
    return {
        "f32": jnp.linspace(-3.0, 3.0, 12, dtype=jnp.float32).reshape(3, 4) / 7,
        "bf16": (jnp.arange(5, dtype=jnp.bfloat16) / 3,),
        "i32": jnp.array([-(2**31), 0, 2**31 - 1], jnp.int32),
        "bool": jnp.array([True, False, True]),
        "keys": [key, jax.random.split(key, 4), jax.random.key(1, impl="rbg")],
        "scalar": jnp.float32(np.pi),
    }


def _assert_bit_exact(restored, original):
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(original), strict=True):
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            assert a.dtype == b.dtype and jax.random.key_impl(a) == jax.random.key_impl(b)
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_round_trip_with_a_target_is_bit_exact_onto_another_device(tmp_path, cpu_devices):
    saving = OneDeviceStrategy("/cpu:0")
    tree = saving.put(_tree())
    checkpoint.save(tmp_path, tree)
    target = OneDeviceStrategy("/cpu:1")
    restored = checkpoint.restore(tmp_path, strategy=target, target=tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    _assert_bit_exact(restored, tree)
    for leaf in jax.tree.leaves(restored):
        assert leaf.devices() == {cpu_devices[1]} and leaf.committed


def test_without_a_target_the_saved_structure_comes_back_as_dicts_and_lists(tmp_path):
    tree = _tree()
    checkpoint.save(tmp_path, tree)
    restored = checkpoint.restore(tmp_path)
    assert isinstance(restored["bf16"], list) and isinstance(restored["keys"], list)
    _assert_bit_exact(restored, tree)


def test_restore_uses_the_current_strategy(tmp_path, strategy_cpu1):
    checkpoint.save(tmp_path, {"w": jnp.ones(3)})
    with strategy_cpu1.scope():
        restored = checkpoint.restore(tmp_path)
    assert restored["w"].devices() == {strategy_cpu1.device} and restored["w"].committed


def test_a_target_of_shape_dtype_structs(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.ones((2, 3)), "k": jax.random.key(0)})
    target = {"w": jax.ShapeDtypeStruct((2, 3), jnp.float32), "k": jax.eval_shape(lambda: jax.random.key(0))}
    restored = checkpoint.restore(tmp_path, target=target)
    assert restored["w"].shape == (2, 3) and jnp.issubdtype(restored["k"].dtype, jax.dtypes.prng_key)


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.linear(x))


def test_an_nnx_model_and_optax_state_round_trip(tmp_path, strategy_cpu1):
    graphdef, state = nnx.split(_Model(nnx.Rngs(0)))
    optimizer = optax.adam(1e-3)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes its int32 count with floats.
        opt_state = optimizer.init(state)
    saved = {"model": state, "optimizer": opt_state}
    checkpoint.save(tmp_path, saved)
    fresh = {"model": nnx.split(_Model(nnx.Rngs(1)))[1], "optimizer": opt_state}
    restored = checkpoint.restore(tmp_path, strategy=strategy_cpu1, target=fresh)
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    _assert_bit_exact(restored, saved)
    model = nnx.merge(graphdef, restored["model"])
    assert model(jnp.ones((1, 3))).shape == (1, 2)


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


def _zero_size_tree():
    return {
        "rows": jnp.zeros((0, 3)),
        "nested": [np.zeros((2, 0), np.int32), jnp.ones(2)],
        "bf16": jnp.zeros((0,), jnp.bfloat16),
        "keys": jax.random.split(jax.random.key(0), 0),
    }


def test_zero_size_arrays_round_trip(tmp_path, strategy_cpu1):
    tree = _zero_size_tree()
    checkpoint.save(tmp_path, tree)
    _assert_bit_exact(checkpoint.restore(tmp_path), tree)
    restored = checkpoint.restore(tmp_path, strategy=strategy_cpu1, target=tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    _assert_bit_exact(restored, tree)
    for leaf in jax.tree.leaves(restored):
        assert leaf.devices() == {strategy_cpu1.device} and leaf.committed


def test_a_target_differing_in_a_zero_size_shape_is_reported(tmp_path):
    checkpoint.save(tmp_path, _zero_size_tree())
    target = {**_zero_size_tree(), "rows": jnp.zeros((0, 4))}
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=r"nothing was restored:\n  rows: the checkpoint has float32\[0, 3\], the target float32\[0, 4\]$",
    ):
        checkpoint.restore(tmp_path, target=target)


# --- Checkpointer ------------------------------------------------------------------------------


def test_checkpointer_keeps_the_newest_steps_and_honours_the_interval(tmp_path):
    with checkpoint.Checkpointer(tmp_path, max_to_keep=2, save_interval_steps=2) as checkpointer:
        saved = [checkpointer.save(step, {"step": jnp.int32(step)}) for step in range(7)]
        checkpointer.wait()
        assert saved == [True, False, True, False, True, False, True]
        assert checkpointer.all_steps() == [4, 6] and checkpointer.latest_step() == 6
        assert checkpointer.restore()["step"].tolist() == 6
        assert checkpointer.restore(4)["step"].tolist() == 4
        assert checkpointer.save(7, {"step": jnp.int32(7)}, force=True)


def test_checkpointer_save_returns_before_the_files_are_written(tmp_path):
    big = {"w": jnp.ones((1024, 1024, 16))}  # 64 MiB
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(0, big)
        checkpointer.wait()
        assert checkpointer.all_steps() == [0]


def test_saving_a_step_twice_is_an_error(tmp_path):
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(3, {"w": jnp.ones(1)})
        checkpointer.wait()
        with pytest.raises(FileExistsError, match=rf"step 3 is already saved in {tmp_path}; steps must grow"):
            checkpointer.save(3, {"w": jnp.ones(1)})
    with pytest.raises(FileExistsError, match="step 3 is already saved"):
        checkpoint.save(tmp_path, {"w": jnp.ones(1)}, step=3)


def test_saving_an_older_step_than_the_newest_is_an_error(tmp_path):
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        checkpointer.save(10, {"w": jnp.ones(1)})
        with pytest.raises(
            ValueError, match=r"step 7 is older than the newest saved step 10 .* Save under a step above 10"
        ):
            checkpointer.save(7, {"w": jnp.ones(1)})


@pytest.mark.parametrize(("tree", "what"), [({}, "holds no array"), (jnp.ones(2), "is a single array")])
def test_trees_that_cannot_be_saved(tmp_path, tree, what):
    with pytest.raises(ValueError, match=rf"the tree {what}.* such as \{{'params': params\}}"):
        checkpoint.save(tmp_path, tree)
    assert list(tmp_path.iterdir()) == [], "nothing half-written is left behind"


def test_save_without_a_step_numbers_them(tmp_path):
    assert [checkpoint.save(tmp_path, {"w": jnp.ones(1)}) for _ in range(3)] == [0, 1, 2]


@pytest.mark.parametrize("step", [-1, 1.0, True, "3"])
def test_bad_steps(tmp_path, step):
    with (
        checkpoint.Checkpointer(tmp_path) as checkpointer,
        pytest.raises(ValueError, match=r"step must be an int >= 0"),
    ):
        checkpointer.save(step, {"w": jnp.ones(1)})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"max_to_keep": 0}, "max_to_keep=0"), ({"save_interval_steps": 0}, "save_interval_steps=0")],
)
def test_bad_checkpointer_options(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=rf"Checkpointer\({message}\): expected"):
        checkpoint.Checkpointer(tmp_path, **kwargs)


def test_leaves_that_are_not_arrays_are_rejected(tmp_path):
    with pytest.raises(TypeError, match=r"every leaf must be an array:\n  tree\['name'\] is a str"):
        checkpoint.save(tmp_path, {"w": jnp.ones(1), "name": "x"})


def test_saving_with_a_closed_checkpointer_is_a_clear_error(tmp_path):
    checkpointer = checkpoint.Checkpointer(tmp_path)
    checkpointer.save(0, {"w": jnp.ones(1)})
    checkpointer.close()
    with pytest.raises(
        RuntimeError,
        match=rf"Checkpointer.save\(\): this Checkpointer of {tmp_path} is closed \(by close\(\) or by "
        rf"leaving its `with` block\), so it cannot save. .* create a new Checkpointer\('{tmp_path}'\)",
    ):
        checkpointer.save(1, {"w": jnp.ones(1)})
    assert checkpointer.all_steps() == [0], "nothing was started in the background"
    assert checkpointer.restore()["w"].tolist() == [1.0], "reading still works"
    checkpointer.close()


def _skipped(tmp_path, caller, *steps):
    names = ", ".join(repr(str(tmp_path / step)) for step in steps)
    return re.escape(f"{caller}: skipping [{names}]: step directories that hold no complete checkpoint")


def test_stray_step_directories_are_skipped_with_one_warning(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    (tmp_path / "5").mkdir()
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "weights.bin").write_bytes(b"written by something else")
    (tmp_path / "notes.txt").write_text("not named like a step, so not reported")
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        with pytest.warns(UserWarning, match=_skipped(tmp_path, "Checkpointer.latest_step()", "5", "7")):
            assert checkpointer.latest_step() == 0
        with pytest.warns(UserWarning, match=_skipped(tmp_path, "Checkpointer.all_steps()", "5", "7")):
            assert checkpointer.all_steps() == [0]
        with pytest.warns(
            UserWarning, match=_skipped(tmp_path, "Checkpointer.restore()", "5", "7")
        ) as record:
            assert checkpointer.restore()["w"].tolist() == [1.0]
        assert len(record) == 1
    with pytest.warns(UserWarning, match=r"Delete them, or move them out of .*, to silence this warning"):
        assert checkpoint.restore(tmp_path)["w"].tolist() == [1.0]


def test_restoring_a_stray_step_by_number_is_a_corrupt_checkpoint(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    (tmp_path / "5").mkdir()
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=rf"Cannot read the checkpoint at step 5 in {tmp_path}: {tmp_path / '5'} holds no complete "
        r"checkpoint .* Restore one of the complete steps \[0\], or delete it",
    ):
        checkpoint.restore(tmp_path, step=5)


def test_saving_into_a_stray_step_directory_is_an_error(tmp_path):
    (tmp_path / "5").mkdir()
    with pytest.raises(
        FileExistsError,
        match=rf"Checkpointer.save\(\): {tmp_path / '5'} exists but holds no complete checkpoint .* "
        "Delete it, or save under another step number",
    ):
        checkpoint.save(tmp_path, {"w": jnp.ones(1)}, step=5)
    assert checkpoint.save(tmp_path, {"w": jnp.ones(1)}) == 6, "numbered past the stray directory"


def test_a_stray_step_directory_neither_stops_saves_nor_is_deleted(tmp_path):
    (tmp_path / "9").mkdir()
    with checkpoint.Checkpointer(tmp_path, max_to_keep=1) as checkpointer:
        assert checkpointer.save(0, {"w": jnp.zeros(1)}) and checkpointer.save(1, {"w": jnp.ones(1)})
        checkpointer.wait()
        with pytest.warns(UserWarning, match=_skipped(tmp_path, "Checkpointer.all_steps()", "9")):
            assert checkpointer.all_steps() == [1]
    assert (tmp_path / "9").is_dir()


def test_lazy_submodule_attribute():
    assert jaxstrategy.checkpoint is checkpoint


# --- errors naming the path --------------------------------------------------------------------


def test_a_missing_directory(tmp_path):
    missing = tmp_path / "nothing-here"
    with pytest.raises(
        checkpoint.CheckpointNotFoundError, match=rf"No checkpoint directory at {missing}"
    ) as info:
        checkpoint.restore(missing)
    assert isinstance(info.value, FileNotFoundError)
    assert not missing.exists(), "restore does not create the directory"


@pytest.mark.parametrize(
    ("call", "caller"),
    [
        (lambda: checkpoint.save("", {"w": jnp.ones(1)}), "checkpoint.save()"),
        (lambda: checkpoint.restore(""), "checkpoint.restore()"),
        (lambda: checkpoint.Checkpointer(""), "Checkpointer()"),
    ],
)
def test_an_empty_directory_is_rejected(tmp_path, monkeypatch, call, caller):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError,
        match=re.escape(f"{caller}: directory is empty (''); expected the path of a checkpoint directory.")
        + r".* or '\.' for the current directory",
    ):
        call()
    assert list(tmp_path.iterdir()) == [], "nothing is written into the current directory"


def test_a_tilde_stands_for_the_home_directory(tmp_path, monkeypatch):
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    checkpoint.save("~/ckpt", {"w": jnp.ones(1)})
    assert (home / "ckpt" / "0").is_dir() and list(elsewhere.iterdir()) == []
    assert checkpoint.restore("~/ckpt")["w"].tolist() == [1.0]
    with checkpoint.Checkpointer(Path("~") / "ckpt") as checkpointer:
        assert checkpointer.directory == home / "ckpt" and checkpointer.all_steps() == [0]


def test_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(
        checkpoint.CheckpointNotFoundError, match=rf"{tmp_path} is not a checkpoint directory: .*'notes.txt'"
    ):
        checkpoint.restore(tmp_path)


def test_a_missing_step_lists_the_saved_ones(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    with pytest.raises(
        checkpoint.CheckpointNotFoundError,
        match=rf"No complete checkpoint for step 5 in {tmp_path}; it holds steps \[0\]",
    ):
        checkpoint.restore(tmp_path, step=5)


def _largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def test_a_truncated_checkpoint_is_a_clear_error(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(100_000, dtype=jnp.float32)})
    data = _largest_file(tmp_path / "0" / "state")
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

_SAVER = textwrap.dedent(
    """
    import sys, time
    import jax.numpy as jnp
    from jaxstrategy import checkpoint

    directory = sys.argv[1]
    checkpoint.save(directory, {"w": jnp.full((4,), 1.0)}, step=0)
    print("saved 0", flush=True)
    big = {f"w{i}": jnp.full((2048, 2048), float(i)) for i in range(64)}  # 1 GiB: slow to write
    with checkpoint.Checkpointer(directory) as checkpointer:
        checkpointer.save(1, big)
        print("saving 1", flush=True)
        time.sleep(600)
    """
)


@pytest.mark.slow  # Starts processes.
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    with subprocess.Popen(
        [sys.executable, "-c", _SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as child:
        try:
            assert child.stdout.readline() == "saved 0\n"
            deadline = time.monotonic() + 120
            while not any(entry.name.startswith("1.") for entry in tmp_path.iterdir()):
                assert time.monotonic() < deadline, "step 1 never started writing"
                assert child.poll() is None, "the saver ended before it was killed"
                time.sleep(0.002)
            assert not (tmp_path / "1").exists(), "step 1 finished before it could be killed"
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=60)
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [0] and checkpointer.latest_step() == 0
        assert checkpointer.restore()["w"].tolist() == [1.0] * 4


# --- leaves stored under one name --------------------------------------------------------------


@pytest.mark.parametrize(
    ("tree", "clash"),
    [
        (
            {"a.b": jnp.float32(1.0), "a": {"b": jnp.float32(2.0)}},
            "tree['a']['b'] and tree['a.b'] are both stored as 'a.b'",
        ),
        (
            {"a/b": jax.random.key(0), "a": {"b": jnp.zeros(2, jnp.uint32)}},
            "tree['a']['b'] and tree['a/b'] are both stored as 'a/b'",
        ),
        (
            {"a/b": jnp.ones(3), "a": {"b": jnp.ones((2, 2))}},
            "tree['a']['b'] and tree['a/b'] are both stored as 'a/b'",
        ),
    ],
    ids=["dot", "prng-key-and-raw", "slash-shapes"],
)
def test_leaves_stored_under_one_name_are_refused_at_save(tmp_path, tree, clash):
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Checkpointer.save(): leaves of the tree would be stored under the same name, and restore "
            f"as one another:\n  {clash}\nRename the keys"
        ),
    ):
        checkpoint.save(tmp_path, tree)
    assert list(tmp_path.iterdir()) == [], "nothing half-written is left behind"


def test_keys_holding_dots_and_slashes_round_trip_when_distinct(tmp_path):
    tree = {"a.b": jnp.float32(1.0), "c/d": jax.random.key(3), "a": {"c": jnp.float32(2.0)}}
    checkpoint.save(tmp_path, tree)
    _assert_bit_exact(checkpoint.restore(tmp_path, target=tree), tree)
    _assert_bit_exact(checkpoint.restore(tmp_path), tree)


# --- 64-bit leaves -----------------------------------------------------------------------------


def test_an_int64_leaf_too_large_for_int32_is_an_overflow_error(tmp_path):
    checkpoint.save(tmp_path, {"i": np.array([1, 2**40 + 5], np.int64), "w": jnp.ones(1)})
    for target in (None, {"i": np.zeros(2, np.int64), "w": jnp.ones(1)}):
        with pytest.raises(
            OverflowError,
            match=re.escape(
                f"Cannot restore the checkpoint at step 0 in {tmp_path}: leaves hold values too large "
                "for the 32-bit integers JAX uses while `jax_enable_x64` is off:\n"
                "  i: int64 values from 1 to 1099511627781, beyond int32\nTurn on 64-bit mode"
            ),
        ):
            checkpoint.restore(tmp_path, target=target)


def test_64_bit_leaves_that_fit_are_narrowed_onto_the_strategy(tmp_path, strategy_cpu1):
    tree = {"i": np.array([-(2**31), 2**31 - 1], np.int64), "u": np.array([2**32 - 1], np.uint64)}
    checkpoint.save(tmp_path, tree)
    restored = checkpoint.restore(tmp_path, strategy=strategy_cpu1)
    assert (restored["i"].dtype, restored["i"].tolist()) == (jnp.int32, [-(2**31), 2**31 - 1])
    assert (restored["u"].dtype, restored["u"].tolist()) == (jnp.uint32, [2**32 - 1])
    for leaf in restored.values():
        assert leaf.devices() == {strategy_cpu1.device} and leaf.committed


def test_a_float64_leaf_restores_as_float32_with_a_warning(tmp_path):
    checkpoint.save(tmp_path, {"f": np.array([0.1], np.float64), "w": jnp.ones(1)})
    with pytest.warns(
        UserWarning,
        match=re.escape(
            f"Restoring the checkpoint at step 0 in {tmp_path}: ['f (float64 as float32)'] come back "
            "with less precision"
        )
        + r".*jax_enable_x64",
    ):
        restored = checkpoint.restore(tmp_path, target={"f": np.zeros(1, np.float64), "w": jnp.ones(1)})
    assert restored["f"].dtype == jnp.float32 and restored["f"].tolist() == [np.float32(0.1)]


def test_64_bit_leaves_round_trip_exactly_with_x64_on(tmp_path):
    with jax.enable_x64(True):
        tree = {"i": jnp.array([2**40 + 5], jnp.int64), "f": jnp.array([0.1], jnp.float64)}
        checkpoint.save(tmp_path, tree)
        _assert_bit_exact(checkpoint.restore(tmp_path), tree)


# --- checkpoints written by orbax alone --------------------------------------------------------


def test_a_checkpoint_of_orbax_standard_checkpointer_restores(tmp_path, strategy_cpu1):
    import orbax.checkpoint as ocp

    tree = {"w": jnp.arange(6.0).reshape(2, 3), "layers": [jnp.int32(3)]}
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "plain", tree)
    restored = checkpoint.restore(tmp_path / "plain", strategy=strategy_cpu1)
    _assert_bit_exact(restored, tree)
    assert restored["w"].devices() == {strategy_cpu1.device} and restored["w"].committed
    _assert_bit_exact(checkpoint.restore(tmp_path / "plain", target=tree), tree)
    with pytest.raises(
        checkpoint.CheckpointNotFoundError,
        match=rf"{tmp_path / 'plain'} is a single checkpoint written by orbax's StandardCheckpointer, "
        r"without steps, so it has no step 3. Restore it with step=None",
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
        match=rf"No checkpoint for step 5 in {tmp_path}, written by orbax's CheckpointManager; it holds "
        r"steps \[1, 2\]",
    ):
        checkpoint.restore(tmp_path, step=5)


# --- checksums ---------------------------------------------------------------------------------


def _flip(path: Path, start: int, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[start : start + count] = bytes(byte ^ 0xFF for byte in data[start : start + count])
    path.write_bytes(bytes(data))


def _save_damaged(directory: Path, leaf, fraction: float, count: int) -> np.ndarray:
    """Save {'w': leaf, 'b': {'c': ...}}, flip `count` bytes of the array data file at `fraction`
    of its length, and return w's values as saved."""
    checkpoint.save(directory, {"w": leaf, "b": {"c": jnp.ones(5)}})
    data = _largest_file(directory / "0" / "state")  # w's compressed chunk, in orbax's OCDBT store
    _flip(data, int(data.stat().st_size * fraction), count)
    return np.asarray(leaf)


_DAMAGED = r"the bytes read for these leaves differ from those saved \(their checksums, written with the step, do not match\), so its files were damaged or changed after the save:\n  w: checksum 0x[0-9a-f]{8}, saved 0x[0-9a-f]{8}\nRestore another step, or restore with verify=False"


@pytest.mark.parametrize("count", [1, 64], ids=["1-byte", "64-bytes"])
@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75])
def test_flipped_bytes_in_the_array_data_are_a_corrupt_checkpoint_naming_the_leaf(tmp_path, fraction, count):
    values = jnp.asarray(np.random.default_rng(0).standard_normal(100_000, dtype=np.float32))
    saved = _save_damaged(tmp_path, values, fraction, count)
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=re.escape(f"Cannot read the checkpoint at step 0 in {tmp_path}: ") + _DAMAGED,
    ):
        checkpoint.restore(tmp_path)
    damaged = checkpoint.restore(tmp_path, verify=False)["w"]
    assert not np.array_equal(np.asarray(damaged), saved), "the flip landed in w's values"


def test_damage_that_orbax_cannot_decompress_is_a_corrupt_checkpoint_naming_the_leaf(tmp_path):
    values = jnp.asarray(np.random.default_rng(0).standard_normal(100_000, dtype=np.float32))
    # One leaf: orbax abandons the reads of the others when one fails, and those print
    # "Exception ignored" at a time of the garbage collector's choosing, which pytest reports.
    checkpoint.save(tmp_path, {"w": values})
    _flip(_largest_file(tmp_path / "0" / "state"), 5, 1)  # In the header of w's zstd frame.
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=re.escape(
            f"Cannot read the checkpoint at step 0 in {tmp_path}: the data of the leaf 'w' cannot be "
            "read, so its files were damaged or changed after the save ("
        )
        + r".*ZSTD.*\)\. Restore another step\.$",
    ):
        checkpoint.restore(tmp_path)


def test_a_leaf_sharded_over_devices_is_checked_too(tmp_path, cpu_devices):
    mesh = jax.sharding.Mesh(np.array(cpu_devices[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    values = np.random.default_rng(1).standard_normal(100_000, dtype=np.float32)
    checkpoint.save(tmp_path / "whole", {"w": jax.device_put(values, sharding)})
    assert np.array_equal(np.asarray(checkpoint.restore(tmp_path / "whole")["w"]), values)
    _save_damaged(tmp_path / "damaged", jax.device_put(values, sharding), 0.5, 64)
    with pytest.raises(checkpoint.CorruptCheckpointError, match=_DAMAGED):
        checkpoint.restore(tmp_path / "damaged")


def test_every_kind_of_leaf_restores_through_its_checksum(tmp_path):
    tree = {**_tree(), "empty": _zero_size_tree(), "i64": np.array([-(2**31)], np.int64)}
    checkpoint.save(tmp_path, tree)
    record = (tmp_path / "0" / "checksums" / "checksums.json").read_text()
    assert all(f'"{name}' in record for name in ("f32", "bf16/0", "keys/1", "empty/rows", "i64"))
    restored = checkpoint.restore(tmp_path, target={**tree, "i64": np.zeros(1, np.int64)})
    _assert_bit_exact({key: restored[key] for key in _tree()}, _tree())


def test_a_step_saved_without_checksums_restores_unchecked(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    shutil.rmtree(tmp_path / "0" / "checksums")  # As saved before jaxstrategy wrote them.
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0, 1.0, 2.0]


def test_checksums_of_an_unknown_algorithm_are_a_clear_error(tmp_path):
    checkpoint.save(tmp_path, {"w": jnp.arange(3.0)})
    record = tmp_path / "0" / "checksums" / "checksums.json"
    record.write_text(record.read_text().replace("crc32", "sha3"))
    with pytest.raises(
        checkpoint.CorruptCheckpointError,
        match=r"its checksums are of the algorithm 'sha3 of 4 KiB block sums', and this version of "
        r"jaxstrategy knows only 'crc32 of 4 KiB block sums'. Upgrade jaxstrategy, or restore with verify=False",
    ):
        checkpoint.restore(tmp_path)
    assert checkpoint.restore(tmp_path, verify=False)["w"].tolist() == [0.0, 1.0, 2.0]


# --- one writer per directory ------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import json, sys, time
    import jax.numpy as jnp
    from jaxstrategy import checkpoint

    directory, writer, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    time.sleep(max(0.0, start - time.time()))  # Both writers start together.
    for attempt in range(4):
        value = 100 * writer + attempt
        try:
            step = checkpoint.save(directory, {"who": jnp.full((512, 512), value, jnp.float32)})
            print(json.dumps(["saved", step, value]), flush=True)
        except Exception as error:
            print(json.dumps([type(error).__name__, str(error)]), flush=True)
    """
)


@pytest.mark.slow  # Starts processes.
def test_two_independent_writers_never_lose_a_save(tmp_path):
    start = time.time() + 8  # Past both imports of JAX.
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(tmp_path), str(writer), str(start)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for writer in (1, 2)
    ]
    outputs = []
    try:
        for writer in writers:
            out, err = writer.communicate(timeout=180)  # A hang fails here.
            assert writer.returncode == 0, err
            assert "Traceback" not in err, err
            outputs.append([json.loads(line) for line in out.splitlines()])
    finally:
        for writer in writers:
            writer.kill()
    saved = [
        (step, value)
        for lines in outputs
        for kind, *rest in lines
        if kind == "saved"
        for step, value in [rest]
    ]
    refused = [
        (index, rest[0]) for index, lines in enumerate(outputs) for kind, *rest in lines if kind != "saved"
    ]
    assert saved, outputs
    for index, message in refused:  # Only refusals, each naming the directory and the other writer.
        other = writers[1 - index].pid
        assert re.match(
            _locked(tmp_path, other)
            + r" \(holding it since .*\)\. Two independent writers in one directory lose each other's "
            r"saves \(to each other's max_to_keep, or to one step number\)\. Stop that writer, or save to "
            r"another directory\.$",
            message,
        ), message
    steps = [step for step, _ in saved]
    assert len(set(steps)) == len(steps), f"two saves reported as one step: {saved}"
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == sorted(steps)
        for step, value in saved:  # Every save reported is there, intact.
            assert checkpointer.restore(step)["who"][0, 0].tolist() == value
    assert not (tmp_path / ".jaxstrategy.lock").exists()


def _locked(directory: Path, pid: int) -> str:
    """The start of the message of a CheckpointLockedError for a save into `directory`, as a regex."""
    return re.escape(
        f"checkpoint.save(): cannot save into {directory}: another writer's save there is in flight "
        f"({directory / '.jaxstrategy.lock'}): process {pid} on host {socket.gethostname()!r}"
    )


@pytest.mark.slow  # Starts processes.
def test_a_checkpointer_holds_its_directory_while_a_save_is_in_flight(tmp_path):
    program = "import sys, jax.numpy as jnp; from jaxstrategy import checkpoint; checkpoint.save(sys.argv[1], {'w': jnp.ones(1)})"
    holder = checkpoint.Checkpointer(tmp_path)
    holder.save(0, {"w": jnp.zeros(1)})  # On disk once the holder waits.
    other = subprocess.run(
        [sys.executable, "-c", program, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert other.returncode == 1
    assert re.search(f"CheckpointLockedError: {_locked(tmp_path, os.getpid())}", other.stderr), other.stderr
    with pytest.raises(
        checkpoint.CheckpointLockedError,
        match=r"another Checkpointer of this process, whose save is on disk once it waits \(wait\(\), its "
        r"next save\(\), restore\(\) or close\(\)\)\. Save through one Checkpointer per directory, or "
        r"wait\(\) for the other's save first\.$",
    ) as info:
        checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    assert isinstance(info.value, RuntimeError)
    assert holder.save(1, {"w": jnp.ones(1)}), "the holder saves on"
    holder.wait()
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["0", "1"], "no lock file at rest"
    assert checkpoint.save(tmp_path, {"w": jnp.ones(1)}) == 2, "and the next writer gets in"
    holder.close()


_HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import jax.numpy as jnp
    from jaxstrategy import checkpoint

    directory, forks = Path(sys.argv[1]), sys.argv[2] == "forks"
    checkpointer = checkpoint.Checkpointer(directory)
    checkpointer.save(0, {"w": jnp.zeros(1)})  # Locked until it waits, which it never does.
    while not (directory / "0").is_dir():  # On disk.
        time.sleep(0.01)
    if forks and os.fork() == 0:  # A worker that outlives it, as data loaders' may.
        time.sleep(600)
        os._exit(0)
    print("holding", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow  # Starts processes.
@pytest.mark.parametrize("forks", [False, True], ids=["alone", "with-a-forked-child-alive"])
def test_the_lock_of_a_killed_writer_is_taken_over_with_a_warning(tmp_path, forks):
    with subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), "forks" if forks else "alone"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # Its forked child too is killed at the end, with the group.
    ) as holder:
        try:
            assert holder.stdout.readline() == "holding\n"
            os.kill(holder.pid, signal.SIGKILL)  # The child, if any, lives on.
            holder.wait(timeout=60)
            _assert_taken_over(tmp_path, holder.pid)
        finally:
            with contextlib.suppress(ProcessLookupError):  # None left, without a child.
                os.killpg(holder.pid, signal.SIGKILL)


def _assert_taken_over(tmp_path: Path, pid: int) -> None:
    (tmp_path / "1.orbax-checkpoint-tmp" / "state").mkdir(parents=True)  # What a killed save leaves.
    with pytest.warns(
        UserWarning,
        match=re.escape(
            f"checkpoint.save(): took over the lock of {tmp_path} from process {pid} on host "
            f"{socket.gethostname()!r} (holding it since "
        )
        + r".*\), which ended without releasing it \(it crashed or was killed\); the unfinished saves it "
        "left are removed.",
    ):
        assert checkpoint.save(tmp_path, {"w": jnp.ones(1)}, step=1) == 1
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["0", "1"]


_JOB = textwrap.dedent(
    """
    import sys
    import numpy as np
    import jaxstrategy
    from jaxstrategy import checkpoint

    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    directory = sys.argv[1]
    w = strategy.put(np.arange(6, dtype=np.float32))
    with checkpoint.Checkpointer(directory, max_to_keep=2) as checkpointer:
        for step in range(3):
            checkpointer.save(step, {"w": w * step})
    print(checkpoint.save(directory, {"w": w * 10}), flush=True)
    """
)


@pytest.mark.slow  # Starts processes.
def test_the_processes_of_one_job_save_into_one_directory(tmp_path):
    results = run_local_workers(["-c", _JOB, str(tmp_path)], timeout=240)
    outcomes = [(result.returncode, result.stdout.splitlines()[-1:]) for result in results]
    assert outcomes == [(0, ["3"])] * 2, [result.stderr[-3000:] for result in results]
    with checkpoint.Checkpointer(tmp_path) as checkpointer:
        assert checkpointer.all_steps() == [1, 2, 3]
        assert checkpointer.restore(3)["w"].tolist() == [10.0 * i for i in range(6)]


# --- failed writes -----------------------------------------------------------------------------

_FILE_SIZE_LIMITED = textwrap.dedent(
    """
    import json, resource, signal, sys
    import jax.numpy as jnp
    import numpy as np
    from jaxstrategy import checkpoint

    directory = sys.argv[1]
    checkpoint.save(directory, {"w": jnp.zeros(4)}, step=0)
    # Writes past 1 MiB fail with EFBIG, as they would with ENOSPC on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))
    big = {"w": jnp.asarray(np.random.default_rng(0).standard_normal(2**20, dtype=np.float32))}
    for step in (1, 2):
        try:
            if step == 1:
                checkpoint.save(directory, big, step=1)
            else:
                with checkpoint.Checkpointer(directory) as checkpointer:
                    checkpointer.save(2, big)  # Fails in the background, raises here at close.
            print(json.dumps(["saved", step]), flush=True)
        except Exception as error:
            print(json.dumps([type(error).__name__, getattr(error, "errno", None), str(error)]), flush=True)
    """
)


@pytest.mark.slow  # Starts processes.
def test_a_write_that_fails_midway_is_one_clear_error_without_tracebacks(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", _FILE_SIZE_LIMITED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(lines) == 2, lines
    for step, (kind, code, message) in zip((1, 2), lines, strict=True):
        assert (kind, code) == ("OSError", errno.EFBIG), message
        assert message.startswith(
            f"[Errno 27] Checkpointer.save(): could not write step {step} to {tmp_path}: File too large "
            "(EFBIG). The file size limit (ulimit -f) stopped the write: raise it, or save elsewhere. "
            "(The error: "
        ), message
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["0"], "no unfinished save is left"
    assert checkpoint.restore(tmp_path)["w"].tolist() == [0.0] * 4


def test_a_file_where_the_directory_should_be_is_one_clear_error(tmp_path, capfd):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(
        NotADirectoryError,
        match=re.escape(
            f"Checkpointer(): could not create the directory {blocker / 'ckpt'}: Not a directory (ENOTDIR). "
            "A file stands where a directory is expected: move it, or save elsewhere."
        ),
    ):
        checkpoint.save(blocker / "ckpt", {"w": jnp.ones(1)})
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_one_clear_error(tmp_path, capfd):
    checkpoint.save(tmp_path, {"w": jnp.ones(1)})
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(
            PermissionError,
            match=re.escape(
                f"checkpoint.save(): cannot lock {tmp_path} to save there: Permission denied (EACCES). "
                "This user may not write there: change its permissions, or save elsewhere."
            ),
        ):
            checkpoint.save(tmp_path, {"w": jnp.zeros(1)})
        assert checkpoint.restore(tmp_path)["w"].tolist() == [1.0], "reading still works"
    finally:
        tmp_path.chmod(0o755)
    assert "Traceback" not in capfd.readouterr().err
