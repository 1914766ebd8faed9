# The README's commands. Each target sets itself up from nothing: `make demo` and `make test` on a
# fresh clone create .venv, install the project with the extras they need, then run.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# One stamp per set of extras, so `make demo` does not install the linters.
$(VENV)/.demo-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[demo]"
	touch $@

$(VENV)/.test-installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[test,lint,demo]"
	touch $@

demo: $(VENV)/.demo-installed
	$(BIN)/python examples/train_digits.py

test: lint
	$(BIN)/python -m pytest

lint: $(VENV)/.test-installed
	$(BIN)/ruff check jaxstrategy jaxstrategy_pytest.py tests bench examples conftest.py
	$(BIN)/ruff format --check jaxstrategy jaxstrategy_pytest.py tests bench examples conftest.py
	$(BIN)/mypy jaxstrategy jaxstrategy_pytest.py

bench: $(VENV)/.test-installed
	$(BIN)/python bench/run_overhead.py
	$(BIN)/python bench/input_pipeline.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/mirrored.py
	$(BIN)/python bench/multi_worker.py
	$(BIN)/python bench/nnx.py

clean:
	rm -rf $(VENV) build *.egg-info demo_output
