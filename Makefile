# The README's commands. Each target sets itself up from nothing: `make demo` and `make test` on a
# fresh clone create .venv, install the project with the extras they need, then run.
PYTHON ?= python3
# Python keeps compiled modules, and pytest its rewritten test modules, in __pycache__ between
# runs; where the environment sets PYTHONDONTWRITEBYTECODE, every run redid that work (about 8 s
# of each test process's start, on two cores).
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-fast lint docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# One stamp per set of extras, so `make demo` does not install the linters.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,lint,demo,docs]"
	touch $@

$(VENV)/.docs-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[docs]"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/train_digits.py

# pytest-xdist workers for `make test` and `make test-fast` (CI has two cores; the root conftest.py
# says which tests share a worker and sends the slow ones first). The option lives here, not in
# pytest's addopts, so that a plain `pytest tests/input/test_sources.py` stays one process (for -x, --pdb,
# print) and the pytest that tests/strategies/test_multi_worker.py starts in each process of a job runs alone.
TEST_WORKERS ?= 2

test: lint docs
	$(BIN)/python -m pytest -n $(TEST_WORKERS)

# Skips the tests marked slow (jobs of several processes, notebooks, benchmarks, the demo); no lint.
test-fast: $(VENV)/.test-installed
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow"

# The site, from nothing (an incremental build would repeat only the changed pages' warnings),
# strictly: a warning, a broken cross-reference or a broken link inside the site fails it.
docs: $(VENV)/.docs-installed
	rm -rf docs/_build
	$(BIN)/python -m sphinx -W --keep-going -n -q -b html docs docs/_build/html

lint: $(VENV)/.test-installed
	$(BIN)/ruff check jaxstrategy jaxstrategy_pytest.py tests bench examples conftest.py
	$(BIN)/ruff format --check jaxstrategy jaxstrategy_pytest.py tests bench examples conftest.py
	$(BIN)/mypy jaxstrategy jaxstrategy_pytest.py

# bench/vs_keras.py and bench/sharded.py compare with Keras 3 (JAX backend), from the `bench` extra.
$(VENV)/.bench-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[bench]"
	touch $@

bench: $(VENV)/.test-installed $(VENV)/.bench-installed
	$(BIN)/python bench/run_overhead.py
	$(BIN)/python bench/input_pipeline.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/mirrored.py
	$(BIN)/python bench/multi_worker.py
	$(BIN)/python bench/nnx.py
	$(BIN)/python bench/loss_checks.py
	$(BIN)/python bench/vs_keras.py
	$(BIN)/python bench/sharded.py

clean:
	rm -rf $(VENV) build *.egg-info demo_output docs/_build docs/notebooks
