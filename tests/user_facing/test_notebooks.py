"""Every notebook in notebooks/ runs from top to bottom without an error.

Each notebook is read from disk and executed with nbclient in a fresh Python 3 kernel whose working
directory is notebooks/; the executed copy is checked, never written back, so the committed outputs stay
as they are. A failing cell raises nbclient's `CellExecutionError`, which carries its traceback.
"""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.slow  # Each notebook runs in a kernel of its own.

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600

# Lines a notebook must print or display, by file name.
EXPECTED_LINES = {
    "quickstart.ipynb": [
        "90",  # The spec's step_fn loop: print(result)  # 90
        "[(4, 2, 3), (1, 8, 3), (1, 2, 12)]",  # The spec's gather shapes, on four replicas.
        "same losses as on one device: True",  # MirroredStrategy trains as OneDeviceStrategy does.
    ],
    "save_and_load.ipynb": [
        "restored step: 60",  # The newest of the steps the Checkpointer kept.
        "{(CpuDevice(id=1), True)}",  # Every restored leaf: (device, committed) under the new strategy.
        "loss after restore below the initial loss: True",  # Training resumed, not restarted.
    ],
}


def execute(name: str) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    client.execute()
    return notebook


def output_lines(notebook: nbformat.NotebookNode) -> list[str]:
    """The text the code cells printed (stream outputs) or displayed (text/plain)."""
    texts = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            if output.output_type == "stream":
                texts.append(output.text)
            elif "text/plain" in output.get("data", {}):
                texts.append(output.data["text/plain"])
    return "\n".join(texts).splitlines()


def test_every_notebook_with_expected_lines_exists() -> None:
    assert set(EXPECTED_LINES) <= set(NOTEBOOKS), f"notebooks found: {NOTEBOOKS}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name: str) -> None:
    lines = output_lines(execute(name))
    missing = [line for line in EXPECTED_LINES.get(name, []) if line not in lines]
    assert not missing, f"{name} did not print {missing}; it printed:\n" + "\n".join(lines)
