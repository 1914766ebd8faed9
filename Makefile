# The README's commands. Each target sets itself up from nothing: `make test` on a fresh clone
# creates .venv, installs the project with its extras, lints, then runs the tests and doctests.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[test,lint]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/spec_tour.py

test: lint
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check jaxstrategy tests bench examples conftest.py
	$(BIN)/ruff format --check jaxstrategy tests bench examples conftest.py
	$(BIN)/mypy jaxstrategy

bench: $(STAMP)
	$(BIN)/python bench/run_overhead.py

clean:
	rm -rf $(VENV) build *.egg-info
