"""Code that the site shows fits its code boxes: no line longer than 88 characters.

Furo's code boxes show about 90 characters at 1280 px; past that a line sits behind a horizontal
scrollbar, and with it the `# expected` comment that says what the line prints. Checked: the lines
of fenced code blocks in docs/ (```python, ```text, ```sh; MyST directives such as ```{image} hold
options, not code), the source of the notebooks' code cells, and the `>>>` and `...` lines of the
docstrings, counted from the prompt, as the API pages show them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SKIPPED_DIRS = {"_build", "notebooks", "jupyter_execute"}
MAX_LINE = 88

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")

# `describe_layout`'s tables in sharded.md are what the block above them prints, verbatim: their
# last column says why each leaf is laid out as it is, and shortening it by hand would make the page
# show output the code does not give. They are the only blocks let past the limit.
VERBATIM_OUTPUT_HEADER = re.compile(r"path +shape +spec +per device +decided by")


def markdown_code_lines(page: Path) -> list[tuple[int, str]]:
    """The (line number, line) pairs inside the page's fenced code blocks that are checked."""
    lines = page.read_text().splitlines()
    checked = []
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, info = opening.group(2), opening.group(3).strip()
        end = index + 1
        while end < len(lines) and not re.fullmatch(rf"\s*{fence[0]}{{{len(fence)},}}\s*", lines[end]):
            end += 1
        body = list(enumerate(lines[index + 1 : end], start=index + 2))
        is_directive = info.startswith("{")
        is_verbatim_output = info == "text" and body and VERBATIM_OUTPUT_HEADER.match(body[0][1])
        if not is_directive and not is_verbatim_output:
            checked.extend(body)
        index = end + 1
    return checked


def long_lines() -> list[str]:
    found = []
    pages = sorted(p for p in DOCS.rglob("*.md") if not SKIPPED_DIRS & set(p.relative_to(DOCS).parts))
    for page in pages:
        for number, line in markdown_code_lines(page):
            if len(line) > MAX_LINE:
                found.append(f"{page.relative_to(ROOT)}:{number}: {len(line)} characters")
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        for cell_index, cell in enumerate(cells):
            if cell["cell_type"] != "code":
                continue
            for number, line in enumerate("".join(cell["source"]).splitlines(), start=1):
                if len(line) > MAX_LINE:
                    where = f"{notebook.relative_to(ROOT)}: cell {cell_index}, line {number}"
                    found.append(f"{where}: {len(line)} characters")
    for module in sorted((ROOT / "jaxstrategy").rglob("*.py")):
        for number, line in enumerate(module.read_text().splitlines(), start=1):
            example = line.lstrip()
            if example.startswith((">>>", "...")) and len(example) > MAX_LINE:
                found.append(f"{module.relative_to(ROOT)}:{number}: {len(example)} characters")
    return found


def test_code_lines_fit_the_sites_code_boxes():
    found = long_lines()
    assert not found, f"code lines over {MAX_LINE} characters:\n" + "\n".join(found)


def test_the_check_sees_a_long_line_and_skips_directives(tmp_path: Path):
    page = tmp_path / "page.md"
    long = "x = " + "1 + " * 30 + "1"
    page.write_text(
        f"text\n\n```python\nshort = 1\n{long}\n```\n\n```{{image}} a.png\n:alt: {long}\n```\n"
        "\n```text\npath  shape  spec  per device  decided by\n" + "-" * 100 + "\n```\n"
    )
    assert [number for number, _ in markdown_code_lines(page)] == [4, 5]
