"""Trees and file helpers that the checkpoint tests share."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def every_kind_of_leaf():
    """A tree of every dtype family a checkpoint stores, typed PRNG keys of two implementations included."""
    key = jax.random.key(7)
    return {
        "f32": jnp.linspace(-3.0, 3.0, 12, dtype=jnp.float32).reshape(3, 4) / 7,
        "bf16": (jnp.arange(5, dtype=jnp.bfloat16) / 3,),
        "i32": jnp.array([-(2**31), 0, 2**31 - 1], jnp.int32),
        "bool": jnp.array([True, False, True]),
        "keys": [key, jax.random.split(key, 4), jax.random.key(1, impl="rbg")],
        "scalar": jnp.float32(np.pi),
    }


def assert_bit_exact(restored, original):
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(original), strict=True):
        if jnp.issubdtype(b.dtype, jax.dtypes.prng_key):
            assert a.dtype == b.dtype and jax.random.key_impl(a) == jax.random.key_impl(b)
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def zero_size_tree():
    return {
        "rows": jnp.zeros((0, 3)),
        "nested": [np.zeros((2, 0), np.int32), jnp.ones(2)],
        "bf16": jnp.zeros((0,), jnp.bfloat16),
        "keys": jax.random.split(jax.random.key(0), 0),
    }


def largest_file(directory: Path) -> Path:
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
