"""How leaves are stored: zero-size arrays, and 64-bit leaves while x64 is off or on."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from checkpoint_support import assert_bit_exact, zero_size_tree

from jaxstrategy import checkpoint


def test_zero_size_arrays_round_trip(tmp_path, strategy_cpu1):
    tree = zero_size_tree()
    checkpoint.save(tmp_path, tree)
    assert_bit_exact(checkpoint.restore(tmp_path), tree)
    restored = checkpoint.restore(tmp_path, strategy=strategy_cpu1, target=tree)
    assert jax.tree.structure(restored) == jax.tree.structure(tree)
    assert_bit_exact(restored, tree)
    for leaf in jax.tree.leaves(restored):
        assert leaf.devices() == {strategy_cpu1.device} and leaf.committed


def test_a_target_differing_in_a_zero_size_shape_is_reported(tmp_path):
    checkpoint.save(tmp_path, zero_size_tree())
    target = {**zero_size_tree(), "rows": jnp.zeros((0, 4))}
    with pytest.raises(
        checkpoint.CheckpointMismatchError,
        match=r"nothing was restored:\n  rows: the checkpoint has float32\[0, 3\], the target float32\[0, 4\]$",
    ):
        checkpoint.restore(tmp_path, target=target)


def test_an_int64_leaf_too_large_for_int32_is_an_overflow_error(tmp_path):
    checkpoint.save(tmp_path, {"i": np.array([1, 2**40 + 5], np.int64), "w": jnp.ones(1)})
    for target in (None, {"i": np.zeros(2, np.int64), "w": jnp.ones(1)}):
        with pytest.raises(
            OverflowError,
            # The leaf and its values, alone, then the fix.
            match=rf"(?s)step 0 in {re.escape(str(tmp_path))}: .*too large .*32-bit.*:\n"
            r"  i: int64 values from 1 to 1099511627781, beyond int32\nTurn on 64-bit mode",
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
        match=rf"(?s)step 0 in {re.escape(str(tmp_path))}: \['f \(float64 as float32\)'\] come back "
        r"with less precision.*jax_enable_x64",
    ):
        restored = checkpoint.restore(tmp_path, target={"f": np.zeros(1, np.float64), "w": jnp.ones(1)})
    assert restored["f"].dtype == jnp.float32 and restored["f"].tolist() == [np.float32(0.1)]


def test_64_bit_leaves_round_trip_exactly_with_x64_on(tmp_path):
    with jax.enable_x64(True):
        tree = {"i": jnp.array([2**40 + 5], jnp.int64), "f": jnp.array([0.1], jnp.float64)}
        checkpoint.save(tmp_path, tree)
        assert_bit_exact(checkpoint.restore(tmp_path), tree)


# --- checkpoints written by orbax alone --------------------------------------------------------
