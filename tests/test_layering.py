"""The rooms of `jaxstrategy/_src` and the one way their imports flow.

`core` < {`values`, `cluster`} < `steps` < `input` < `strategies` < `checkpoint`: a module may
import from its own room and the rooms below it, never from one above, and `values` and
`cluster` not from each other; and no module imports itself through others, within a room or
across rooms. Every import counts, wherever it stands: at the top, inside a
function, or under `TYPE_CHECKING`. Nothing in `_src` imports the public faces (`jaxstrategy`,
`jaxstrategy.checkpoint`, ..., which sit above every room) or a module of `_src` that is in no
room. No module lives directly in `_src`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "jaxstrategy" / "_src"
PACKAGE = "jaxstrategy._src"
# Each room, with the rooms it may import from (besides itself).
MAY_IMPORT = {
    "core": set(),
    "values": {"core"},
    "cluster": {"core"},
    "steps": {"core", "values", "cluster"},
    "input": {"core", "values", "cluster", "steps"},
    "strategies": {"core", "values", "cluster", "steps", "input"},
    "checkpoint": {"core", "values", "cluster", "steps", "input", "strategies"},
}


# Inside `checkpoint/`, the restore side and the save side do not import each other (format.py).
SIDES = {
    "restore": {"checkpointer", "writer", "lock"},
    "verification": {"checkpointer", "writer", "lock"},
    "block_sums": {"checkpointer", "writer", "lock"},
    "writer": {"restore", "checkpointer"},
    "lock": {"restore", "checkpointer"},
}


def _room(path: Path, src: Path) -> str | None:
    """The room of a module file, or None for a file directly in `_src`."""
    parts = path.relative_to(src).parts
    return parts[0] if len(parts) > 1 else None


def _imported_modules(path: Path, src: Path) -> list[tuple[int, str]]:
    """Every module of jaxstrategy._src that `path` imports, with its line: the absolute name of
    each `import x.y`, each `from x import y` (y itself when it is a module), relative ones too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join([PACKAGE, *path.relative_to(src).parent.parts])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            # `from jaxstrategy._src.values import contexts` imports a module of a room.
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return [
        (line, name) for line, name in found if name.split(".")[0] in ("jaxstrategy", "jaxstrategy_pytest")
    ]


def _target_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] in MAY_IMPORT else None


def layering_violations(src: Path = SRC) -> list[str]:
    """One line per module left directly in `src` and per import against the flow."""
    problems = []
    for path in sorted(src.rglob("*.py")):
        room = _room(path, src)
        shown = path.relative_to(src.parents[1])
        if room is None:
            if path.name != "__init__.py":
                problems.append(f"{shown}: a module directly in _src; put it in one of {sorted(MAY_IMPORT)}")
            continue
        if room not in MAY_IMPORT:
            problems.append(f"{shown}: {room!r} is not a room of the architecture")
            continue
        for line, module in _imported_modules(path, src):
            parts = module.split(".")
            if parts[:2] != ["jaxstrategy", "_src"]:
                problems.append(f"{shown}:{line}: {room} imports {module}, a public face above every room")
                continue
            target = _target_room(module)
            if target is None:
                if len(parts) > 2:  # Not `from jaxstrategy._src import <room>` itself.
                    problems.append(f"{shown}:{line}: {room} imports {module}, which is in no room")
                continue
            if target != room and target not in MAY_IMPORT[room]:
                problems.append(f"{shown}:{line}: {room} imports {module} ({target})")
            elif room == "checkpoint" and len(parts) == 4 and parts[3] in SIDES.get(path.stem, ()):
                problems.append(f"{shown}:{line}: {path.stem}.py imports the other side, {module}")
    return problems


def import_cycles(src: Path = SRC) -> list[str]:
    """One line per cycle of imports between modules of `src` (every import counts, as above):
    the modules of the cycle, each importing the next. Rooms keep imports between rooms acyclic;
    this keeps them acyclic within a room too."""
    modules = {_module_name(path, src): path for path in sorted(src.rglob("*.py"))}
    graph = {
        name: sorted(
            {target for _, imported in _imported_modules(path, src) if (target := _known(imported, modules))}
            - {name}
        )
        for name, path in modules.items()
    }
    cycles: list[str] = []
    state: dict[str, str] = {}  # "open" while on the path being walked, "done" once left.
    path: list[str] = []

    def walk(name: str) -> None:
        state[name] = "open"
        path.append(name)
        for target in graph[name]:
            if state.get(target) == "open":
                cycle = path[path.index(target) :] + [target]
                cycles.append(" -> ".join(module.removeprefix(f"{PACKAGE}.") for module in cycle))
            elif target not in state:
                walk(target)
        path.pop()
        state[name] = "done"

    for name in graph:
        if name not in state:
            walk(name)
    return cycles


def _module_name(path: Path, src: Path) -> str:
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join([PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _known(imported: str, modules: dict[str, Path]) -> str | None:
    """The module of `src` that an import names: itself, or the module a name is taken from."""
    if imported in modules:
        return imported
    parent = imported.rpartition(".")[0]
    return parent if parent in modules and parent.count(".") >= 2 else None


def test_imports_point_down_the_rooms_and_no_module_is_left_in_src():
    assert layering_violations() == []


def test_no_module_imports_itself_through_others():
    assert import_cycles() == []


def test_a_cycle_within_a_room_is_caught(tmp_path):
    src = tmp_path / "jaxstrategy" / "_src"
    (src / "strategies").mkdir(parents=True)
    (src / "strategies" / "a.py").write_text("from jaxstrategy._src.strategies.b import B\n")
    (src / "strategies" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxstrategy._src.strategies import a\n"
    )
    assert import_cycles(src) == ["strategies.a -> strategies.b -> strategies.a"]


def test_every_room_says_what_it_is_for_and_holds_nothing_else():
    for room in MAY_IMPORT:
        init = SRC / room / "__init__.py"
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{init}: a docstring, nothing else"
        assert isinstance(body[0].value, ast.Constant) and body[0].value.value.strip()


@pytest.mark.parametrize(
    ("room", "source", "expected"),
    [
        (
            "values",
            "from jaxstrategy._src.strategies.strategy import Strategy\n",
            "values/offender.py:1: values imports jaxstrategy._src.strategies.strategy (strategies)",
        ),
        (
            "values",
            "import jaxstrategy._src.cluster.coordination\n",
            "values/offender.py:1: values imports jaxstrategy._src.cluster.coordination (cluster)",
        ),
        (
            "cluster",
            "def f():\n    from jaxstrategy._src.values import contexts\n",
            "cluster/offender.py:2: cluster imports jaxstrategy._src.values (values)",
        ),
        (
            "core",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxstrategy._src.steps import cache\n",
            "core/offender.py:3: core imports jaxstrategy._src.steps (steps)",
        ),
        (
            "input",
            "from ..strategies import one_device\n",
            "input/offender.py:1: input imports jaxstrategy._src.strategies (strategies)",
        ),
        (
            "steps",
            "from jaxstrategy import checkpoint\n",
            "steps/offender.py:1: steps imports jaxstrategy, a public face above every room",
        ),
        (
            "checkpoint",
            "def f():\n    import jaxstrategy\n",
            "checkpoint/offender.py:2: checkpoint imports jaxstrategy, a public face above every room",
        ),
        (
            "core",
            "from jaxstrategy._src import input_lib\n",
            "core/offender.py:1: core imports jaxstrategy._src.input_lib, which is in no room",
        ),
    ],
    ids=[
        "upward",
        "sideways",
        "in-a-function",
        "type-checking",
        "relative",
        "public-face",
        "lazy-public",
        "no-room",
    ],
)
def test_an_import_against_the_flow_is_caught(tmp_path, room, source, expected):
    src = tmp_path / "jaxstrategy" / "_src"
    (src / room).mkdir(parents=True)
    (src / room / "offender.py").write_text(source)
    # The module and the module it names are both reported for `from room import module`.
    assert layering_violations(src)[0] == f"jaxstrategy/_src/{expected}"


def test_a_module_directly_in_src_is_caught(tmp_path):
    src = tmp_path / "jaxstrategy" / "_src"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text('"""Private."""\n')
    (src / "stray.py").write_text("")
    assert layering_violations(src) == [
        "jaxstrategy/_src/stray.py: a module directly in _src; put it in one of "
        "['checkpoint', 'cluster', 'core', 'input', 'steps', 'strategies', 'values']"
    ]


def test_the_restore_side_importing_the_save_side_is_caught(tmp_path):
    src = tmp_path / "jaxstrategy" / "_src"
    (src / "checkpoint").mkdir(parents=True)
    (src / "checkpoint" / "restore.py").write_text(
        "from jaxstrategy._src.checkpoint.writer import DirectoryWriter\n"
    )
    (src / "checkpoint" / "writer.py").write_text("from jaxstrategy._src.checkpoint import format, restore\n")
    assert layering_violations(src) == [
        "jaxstrategy/_src/checkpoint/restore.py:1: restore.py imports the other side, "
        "jaxstrategy._src.checkpoint.writer",
        "jaxstrategy/_src/checkpoint/writer.py:1: writer.py imports the other side, "
        "jaxstrategy._src.checkpoint.restore",
    ]
