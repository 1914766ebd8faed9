"""Release habits that a test can hold: the license, the changelog's version, the pre-commit hooks.

The pre-commit hooks must run exactly what `make lint` runs, so that a commit the hooks let through
is one `make lint` (and so CI) lets through too; both files are read here, the Makefile's variables
expanded. PyYAML reads the hooks: flax and orbax-checkpoint require it, so it is installed wherever
jaxstrategy is.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from pathlib import Path

import yaml

import jaxstrategy

ROOT = Path(__file__).resolve().parents[2]

# SHA-256 of the Apache License 2.0 as apache.org publishes it (LICENSE-2.0.txt, appendix included),
# the very file that jax, optax and chex ship.
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"

VARIABLE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
ASSIGNMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?::=|\?=|=)\s*(.*)$")
CHANGELOG_VERSION = re.compile(r"^## (\d+\.\d+\.\d+)(?: \(unreleased\))?$")
CHANGELOG_GROUPS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}


def make_target_commands(makefile: str, target: str) -> list[str]:
    """The recipe of `target` in `makefile`, one command per line, its `$(VARIABLES)` expanded."""
    lines = makefile.replace("\\\n", " ").splitlines()
    variables = {}
    for line in lines:
        assigned = ASSIGNMENT.match(line)
        if assigned:
            variables[assigned.group(1)] = assigned.group(2).strip()

    def expand(text: str) -> str:
        for _ in range(10):  # a variable may name another: BIN := $(VENV)/bin
            text = VARIABLE.sub(lambda found: variables[found.group(1)], text)
        assert "$(" not in text, f"Makefile: cannot expand {text!r}"
        return text

    start = next(i for i, line in enumerate(lines) if re.match(rf"^{re.escape(target)}\s*:", line))
    commands = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        commands.append(" ".join(expand(line.strip()).split()))
    return commands


def pre_commit_hooks() -> list[dict]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return [hook for repo in config["repos"] for hook in repo["hooks"]]


def test_make_target_commands_expands_variables_and_stops_at_the_next_rule():
    makefile = "A := .v\nB := $(A)/bin\n\nx: dep\n\t$(B)/ruff  check a\n\t$(B)/mypy a \\\n\t  b\n\ny:\n\tno\n"
    assert make_target_commands(makefile, "x") == [".v/bin/ruff check a", ".v/bin/mypy a b"]


def test_pre_commit_hooks_run_exactly_the_commands_of_make_lint():
    lint = make_target_commands((ROOT / "Makefile").read_text(), "lint")
    assert lint, "the Makefile has no lint recipe"
    hooks = pre_commit_hooks()
    entries = [" ".join(hook["entry"].split()) for hook in hooks]
    assert entries == lint, (
        ".pre-commit-config.yaml's hooks and the Makefile's lint target run different commands; "
        f"make them the same, in the same order:\n  hooks: {entries}\n  lint:  {lint}"
    )


def test_pre_commit_hooks_use_the_projects_tools_over_the_same_paths():
    for hook in pre_commit_hooks():
        # A hook of another repo, or `language: python`, installs a second copy of the tool, whose
        # version pyproject.toml does not pin; filenames passed on would narrow the paths to the
        # files a commit touches, which mypy checks differently from the whole package.
        assert hook["language"] == "system", f"hook {hook['id']!r}: language {hook['language']!r}"
        assert hook.get("pass_filenames") is False, f"hook {hook['id']!r} passes file names"
        assert hook["entry"].startswith(".venv/bin/"), f"hook {hook['id']!r}: {hook['entry']!r}"
    repos = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"]
    assert [repo["repo"] for repo in repos] == ["local"]


def test_the_license_is_the_apache_license_2_0_verbatim():
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256, (
        "LICENSE is not the Apache License 2.0 word for word; copy it again from a package that "
        "ships it unchanged, such as jax's dist-info/licenses/LICENSE"
    )


def test_the_package_metadata_names_the_license_and_ships_its_file():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    # setuptools puts the files these patterns match into the sdist and the wheel's dist-info.
    shipped = [path.name for pattern in project.get("license-files", []) for path in ROOT.glob(pattern)]
    assert shipped == ["LICENSE"]


def test_the_changelogs_newest_version_is_the_packages():
    headings = [line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")]
    malformed = [heading for heading in headings if not CHANGELOG_VERSION.match(heading)]
    assert not malformed, (
        f"CHANGELOG.md: headings not of the form '## 1.2.3' or '## 1.2.3 (unreleased)': {malformed}"
    )
    versions = [CHANGELOG_VERSION.match(heading).group(1) for heading in headings]
    assert versions[0] == jaxstrategy.__version__, (
        f"CHANGELOG.md's newest section is {versions[0]}, jaxstrategy.__version__ is "
        f"{jaxstrategy.__version__!r}: add a section for the new version at the top"
    )
    as_numbers = [tuple(int(part) for part in version.split(".")) for version in versions]
    assert as_numbers == sorted(set(as_numbers), reverse=True), (
        f"CHANGELOG.md: not newest first, once each: {versions}"
    )
    assert "(unreleased)" not in " ".join(headings[1:]), "only the newest version may be unreleased"


def test_the_changelog_groups_entries_under_keep_a_changelogs_headings():
    groups = [
        line[4:] for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("### ")
    ]
    assert set(groups) <= CHANGELOG_GROUPS, f"CHANGELOG.md: unknown groups {set(groups) - CHANGELOG_GROUPS}"
