# Tessera's build and test entry points. README.md names two of them: `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint native k8s-binaries proto clean

# A virtual environment with the project and its test tools, rebuilt when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

native: $(STAMP)
	$(MAKE) -C hook PYTHON=$(abspath $(BIN)/python)
	$(MAKE) -C tests/fakegpu PYTHON=$(abspath $(BIN)/python)

k8s-binaries:
	hack/k8s-binaries.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP) native k8s-binaries lint
	$(BIN)/pytest

demo: $(STAMP)
	$(BIN)/tessera simulate

clean:
	rm -rf $(VENV) hook/build tests/fakegpu/build
