"""`save`, `restore` and `Checkpointer`: bit-exact round trips onto any strategy, steps, directories, atomic saves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax
import pytest
from checkpoint_support import assert_bit_exact, every_kind_of_leaf

import jaxstrategy
from jaxstrategy import OneDeviceStrategy, checkpoint


def test_round_trip_with_a_target_is_bit_exact_onto_another_device(tmp_path, cpu_devices):
    saving = OneDeviceStrategy("/cpu:0")
    tree = saving.put(every_kind_of_leaf())
    checkpoint.save(tmp_path, tree)
    target = OneDeviceStrategy("/cpu:1")
    restored = checkpoint.restore(tmp_path, strategy=target, target=tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    assert_bit_exact(restored, tree)
    for leaf in jax.tree.leaves(restored):
        assert leaf.devices() == {cpu_devices[1]} and leaf.committed


def test_without_a_target_the_saved_structure_comes_back_as_dicts_and_lists(tmp_path):
    tree = every_kind_of_leaf()
    checkpoint.save(tmp_path, tree)
    restored = checkpoint.restore(tmp_path)
    assert isinstance(restored["bf16"], list) and isinstance(restored["keys"], list)
    assert_bit_exact(restored, tree)


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
    assert_bit_exact(restored, saved)
    model = nnx.merge(graphdef, restored["model"])
    assert model(jnp.ones((1, 3))).shape == (1, 2)


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
        match=rf"(?s)Checkpointer\.save\(\): this Checkpointer of {re.escape(str(tmp_path))} is closed.*"
        rf"create a new Checkpointer\('{re.escape(str(tmp_path))}'\)",
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
        match=rf"(?s)step 5 in {re.escape(str(tmp_path))}: {re.escape(str(tmp_path / '5'))} holds no "
        r"complete checkpoint.*Restore one of the complete steps \[0\], or delete it",
    ):
        checkpoint.restore(tmp_path, step=5)


def test_saving_into_a_stray_step_directory_is_an_error(tmp_path):
    (tmp_path / "5").mkdir()
    with pytest.raises(
        FileExistsError,
        match=rf"(?s)Checkpointer\.save\(\): {re.escape(str(tmp_path / '5'))} exists but holds no complete "
        r"checkpoint.*Delete it, or save under another step number",
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
        match=rf"(?s){re.escape(caller)}: directory is empty \(''\).*or '\.' for the current directory",
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
        # Each clash on its own line, and nothing else listed.
        match=rf"(?s)Checkpointer\.save\(\): .*stored under the same name.*:\n  {re.escape(clash)}\nRename the keys",
    ):
        checkpoint.save(tmp_path, tree)
    assert list(tmp_path.iterdir()) == [], "nothing half-written is left behind"


def test_keys_holding_dots_and_slashes_round_trip_when_distinct(tmp_path):
    tree = {"a.b": jnp.float32(1.0), "c/d": jax.random.key(3), "a": {"c": jnp.float32(2.0)}}
    checkpoint.save(tmp_path, tree)
    assert_bit_exact(checkpoint.restore(tmp_path, target=tree), tree)
    assert_bit_exact(checkpoint.restore(tmp_path), tree)


# --- 64-bit leaves -----------------------------------------------------------------------------
