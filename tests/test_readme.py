"""The README's Python examples run and print what it says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_has_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("block", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(block):
    out = io.StringIO()
    # Users run with JAX's standard promotion; optax mixes its int32 step count with floats.
    with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
        exec(compile(block, str(README), "exec"), {})
    for expected in re.findall(r"print\(.*?\)\s*# (.+)", block):
        assert expected.strip() in out.getvalue(), f"{expected!r} not printed:\n{out.getvalue()}"
