"""Trees, file edits and message patterns that the checkpoint tests share."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy import checkpoint

# A checksum as messages show it.
HEX = "0x[0-9a-f]{8}"


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


def flip_bytes(path: Path, start: int, count: int) -> None:
    """Invert `count` bytes of the file at `path` from `start`, as damage would."""
    data = bytearray(path.read_bytes())
    data[start : start + count] = bytes(byte ^ 0xFF for byte in data[start : start + count])
    path.write_bytes(bytes(data))


def edit_json(path: Path, edit) -> None:
    """Replace the JSON value in the file at `path` by `edit(value)`."""
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def transplant_state(directory: Path, tree, step: int = 0) -> None:
    """Replace the arrays of `step` in `directory` by `tree`'s, saved elsewhere: the bytes on disk
    change as damage would change them, and the rest of the step (its checksums) stays."""
    other = directory.parent / f"{directory.name}-edited"
    checkpoint.save(other, tree, step=step)
    shutil.rmtree(directory / str(step) / "state")
    shutil.copytree(other / str(step) / "state", directory / str(step) / "state")


def iterator_after(strategy, taken: int):
    """An iterator over six batches of a list, `taken` of them taken."""
    iterator = iter(strategy.experimental_distribute_dataset([np.full(2, i, np.float32) for i in range(6)]))
    for _ in range(taken):
        next(iterator)
    return iterator


def damaged_bytes(leaf: str, directory: Path, step: int = 0, label: str = "crc32c") -> str:
    """The pattern of the message for damaged bytes of one region, `leaf` (a pattern, such as
    `re.escape('w[0:4]')`), and nothing else: the step, the region with both sums, and the fix."""
    return (
        rf"(?s)step {step} in {re.escape(str(directory))}: the bytes read .* differ .*:\n"
        rf"  {leaf}: {label} {HEX}, saved {HEX}\nRestore another step, or restore with verify=False"
    )
