"""The README's Python examples run, in order and sharing names as a reader's session would.

The README is what a first visit needs (what it is, the two commands, the example and its
scale-up) and links into docs/; tests/user_facing/test_docs.py tests the pages it links to.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
README_LIMIT_BYTES = 8 * 1024


def test_the_readme_examples_run_and_print_what_they_say():
    assert len(BLOCKS) >= 2
    namespace: dict[str, object] = {}
    for block in BLOCKS:
        out = io.StringIO()
        # Users run with JAX's standard promotion; optax mixes its int32 step count with floats.
        with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
            exec(compile(block, str(README), "exec"), namespace)
        for expected in re.findall(r"print\(.*?\)\s*# (.+)", block):
            assert expected.strip() in out.getvalue(), f"{expected!r} not printed:\n{out.getvalue()}"


def test_the_readme_stays_a_first_visit_page():
    size = len(README.read_bytes())
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/"
    text = README.read_text()
    for command in ("make demo", "make test", "make docs"):
        assert command in text


def test_the_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links into docs/"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
