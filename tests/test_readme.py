"""The README's Python examples run, in order and sharing names as a reader's session would."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import jax

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_examples_run_and_print_what_they_say():
    assert len(BLOCKS) >= 3
    namespace: dict[str, object] = {}
    for block in BLOCKS:
        out = io.StringIO()
        # Users run with JAX's standard promotion; optax mixes its int32 step count with floats.
        with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
            exec(compile(block, str(README), "exec"), namespace)
        for expected in re.findall(r"print\(.*?\)\s*# (.+)", block):
            assert expected.strip() in out.getvalue(), f"{expected!r} not printed:\n{out.getvalue()}"
