"""The documentation's pages: their Python examples run, and every public name has an entry.

Each page's ```python blocks run in order in one namespace, as a reader's session would, and what
a block says it prints must be in what it printed: a `print(...)  # expected` comment, or, where
that line would be too long for the site, a `# -> expected` line directly under the code line
(several such lines in a row are each expected). A block preceded by a
`% test: skip (reason)` line is shown but not run here (the reason says what runs it instead),
one preceded by `% test: requires MODULE` only where MODULE imports (an optional dependency, such as
grain, which the `test` extra installs); blocks preceded by `% file: NAME` are files of a pytest project, run with pytest in a subprocess.
The strict Sphinx build itself (`make docs`, part of `make test`) checks references and links.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
SKIPPED_DIRS = {"_build", "notebooks", "jupyter_execute"}
PAGES = sorted(path for path in DOCS.rglob("*.md") if not SKIPPED_DIRS & set(path.relative_to(DOCS).parts))
# An optional marker line, then a fenced block: (marker kind, marker argument, language, code).
BLOCK = re.compile(r"(?:^% (test|file): ([^\n]*)\n)?^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
EXPECTED = re.compile(r"print\(.*?\)[ \t]*# (.+)")
EXPECTED_BELOW = re.compile(r"^\s*# -> (.+)$")

# Public modules whose every `__all__` name needs an entry in docs/api/.
PUBLIC_MODULES = ("jaxstrategy", "jaxstrategy.checkpoint", "jaxstrategy.nn", "jaxstrategy.testing")
API_ENTRY = re.compile(r"^\.\. (?:autoclass|autofunction|autodata|automodule|data):: (\S+)", re.MULTILINE)
CURRENT_MODULE = re.compile(r"^\.\. currentmodule:: (\S+)", re.MULTILINE)


def blocks(page: Path) -> list[tuple[str | None, str, str, str]]:
    return [
        (kind or None, argument, language, code)
        for kind, argument, language, code in BLOCK.findall(page.read_text())
    ]


def runs(kind: str | None, argument: str) -> bool:
    """Whether a block with this marker runs here: unmarked, or marked `requires MODULE` and
    MODULE is installed (the pages must pass without an optional dependency)."""
    if kind is None:
        return True
    required = re.fullmatch(r"requires ([\w.]+)", argument)
    return kind == "test" and required is not None and importlib.util.find_spec(required.group(1)) is not None


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS))


PAGES_WITH_CODE = [
    page
    for page in PAGES
    if any(language == "python" and runs(kind, argument) for kind, argument, language, _ in blocks(page))
]


def test_the_guides_exist_and_have_examples():
    names = {page_id(page) for page in PAGES_WITH_CODE}
    for guide in (
        "quickstart.md",
        "flax_nnx.md",
        "many_devices.md",
        "many_hosts.md",
        "sharded.md",
        "checkpoints.md",
        "input_pipelines.md",
        "coming_from_tensorflow.md",
    ):
        assert guide in names, f"{guide} has no Python example that runs: {sorted(names)}"


def test_every_skip_marker_gives_a_reason():
    for page in PAGES:
        for kind, argument, _, _ in blocks(page):
            if kind == "test":
                assert re.fullmatch(r"skip \(.+\)|requires [\w.]+", argument), (
                    f"{page_id(page)}: '% test: {argument}'"
                )


def test_a_block_that_requires_a_module_runs_only_where_it_imports():
    assert runs(None, "") and runs("test", "requires json")
    assert not runs("test", "requires no_such_module_here") and not runs("test", "skip (elsewhere)")


# Pages whose examples take over ~2 s (`make test-fast` skips the tests marked slow).
SLOW_PAGES = {"flax_nnx.md", "checkpoints.md", "sharded.md"}


@pytest.mark.parametrize(
    "page",
    [
        pytest.param(page, marks=[pytest.mark.slow] if page_id(page) in SLOW_PAGES else [])
        for page in PAGES_WITH_CODE
    ],
    ids=page_id,
)
def test_the_page_examples_run_and_print_what_they_say(page: Path):
    namespace: dict[str, object] = {"__name__": f"docs.{page.stem}"}
    for kind, argument, language, code in blocks(page):
        if language != "python" or not runs(kind, argument):
            continue
        out = io.StringIO()
        # Users run with JAX's standard promotion; optax mixes its int32 step count with floats.
        with contextlib.redirect_stdout(out), jax.numpy_dtype_promotion("standard"):
            exec(compile(code, str(page), "exec"), namespace)
        check_printed(code, out.getvalue())


def expected_outputs(code: str) -> list[str]:
    """What a block says it prints: trailing `# ...` on print lines, and `# -> ...` lines."""
    expected = [text.strip() for text in EXPECTED.findall(code)]
    lines = code.splitlines()
    for number, line in enumerate(lines):
        below = EXPECTED_BELOW.match(line)
        if below is None:
            continue
        # Directly under a code line, or under a `# ->` line that is: one anywhere else would look
        # like a checked output without saying which line prints it.
        previous = lines[number - 1].strip() if number else ""
        attached = previous and (not previous.startswith("#") or EXPECTED_BELOW.match(previous))
        assert attached, f"'# -> {below.group(1)}' is not directly under a code line:\n{code}"
        expected.append(below.group(1).strip())
    return expected


def check_printed(code: str, printed: str) -> None:
    for expected in expected_outputs(code):
        assert expected in printed, f"{expected!r} not printed:\n{printed}"


def test_expected_output_may_sit_on_the_line_below():
    code = "print(sum([1, 2]),\n      'x')\n# -> 3 x\nprint(4)  # 4\nprint(5, 6)\n# -> 5\n# -> 6\n"
    assert expected_outputs(code) == ["4", "3 x", "5", "6"]
    check_printed(code, "3 x\n4\n5 6\n")
    with pytest.raises(AssertionError, match="'3 x' not printed"):
        check_printed(code, "3 y\n4\n5 6\n")
    with pytest.raises(AssertionError, match="not directly under a code line"):
        expected_outputs("print(1)\n\n# -> 1\n")


@pytest.mark.slow  # starts pytest in a process of its own
def test_the_testing_guide_is_a_pytest_project_that_passes(tmp_path: Path):
    page = DOCS / "testing.md"
    files = [(argument, code) for kind, argument, _, code in blocks(page) if kind == "file"]
    assert {name for name, _ in files} == {"conftest.py", "test_training.py"}
    for name, code in files:
        (tmp_path / name).write_text(code)
    # As a user's shell would start it: the guide's conftest forces the devices, not ours.
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    claimed = re.search(r"^(\d+ passed)$", page.read_text(), flags=re.MULTILINE)
    assert claimed, "the guide shows pytest's summary line"
    assert result.returncode == 0 and claimed.group(1) in result.stdout, result.stdout + result.stderr


def documented_names() -> set[str]:
    """The fully qualified names that docs/api/ pages give an entry."""
    names = set()
    for page in sorted((DOCS / "api").glob("*.md")):
        text = page.read_text()
        # Each entry's name is relative to the `currentmodule` above it.
        for match in API_ENTRY.finditer(text):
            modules = CURRENT_MODULE.findall(text[: match.start()])
            name = match.group(1)
            names.add(name if "." in name or not modules else f"{modules[-1]}.{name}")
    return names


def fixture_names() -> list[str]:
    plugin = importlib.import_module("jaxstrategy_pytest")
    return [
        f"jaxstrategy_pytest.{name}"
        for name, value in vars(plugin).items()
        if hasattr(value, "_fixture_function_marker") or hasattr(value, "_pytestfixturefunction")
    ]


def test_every_public_name_and_fixture_has_an_api_entry():
    public = [
        f"{module}.{name}" for module in PUBLIC_MODULES for name in importlib.import_module(module).__all__
    ]
    fixtures = fixture_names()
    assert {"jaxstrategy_pytest.strategy", "jaxstrategy_pytest.one_device_strategy"} <= set(fixtures)
    missing = sorted(set(public + fixtures) - documented_names())
    assert not missing, f"public names without an entry in docs/api/*.md: {missing}"


def test_every_api_page_and_notebook_is_in_the_site():
    index = (DOCS / "index.md").read_text() + (DOCS / "api" / "index.md").read_text()
    for page in sorted((DOCS / "api").glob("*.md")):
        if page.stem != "index":
            assert re.search(rf"^{page.stem}$", index, flags=re.MULTILINE), (
                f"api/{page.name} not in a toctree"
            )
    for notebook in sorted((DOCS.parent / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{notebook.stem}\n" in index, f"{notebook.name} not in docs/index.md's toctree"
