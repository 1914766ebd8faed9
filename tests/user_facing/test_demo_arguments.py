"""The demo's command line, read in this process (tests/user_facing/test_demo.py runs the demo)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # Importing the demo imports scikit-learn and matplotlib: 2 s.

DEMO = Path(__file__).resolve().parents[2] / "examples" / "train_digits.py"


@pytest.fixture(scope="module")
def demo():
    spec = importlib.util.spec_from_file_location("train_digits", DEMO)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_placement_trains_its_own_run_in_a_folder_of_its_own(demo):
    # One shared folder made the README's second command, `--replicas 4` after `make demo`, find
    # every epoch trained already and do nothing.
    assert demo.parse_args([]).output_dir == Path("demo_output/one_device")
    assert demo.parse_args(["--replicas", "4"]).output_dir == Path("demo_output/4_replicas")
    assert demo.parse_args(["--output-dir", "elsewhere"]).output_dir == Path("elsewhere")
