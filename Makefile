# The README's two commands: `make demo` and `make test`. Each builds .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch, pinned here (not in pyproject) so the install stays small on CPU machines;
# override on a GPU box, e.g. `make install TORCH_SPEC='torch==2.13.0'` from the CUDA index.
TORCH_SPEC ?= torch==2.13.0
# No RAY_AUTH_MODE here: the local stack runs with Ray token auth and hands its mode and token to every process
# and client it starts (`elastic local env` prints them).

.PHONY: install demo lint test test-unit test-integration down clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet '$(TORCH_SPEC)'
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

demo: install
	$(BIN)/elastic demo

LINTED := elastic tests jobs bench

lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)

test: lint
	$(BIN)/python -m pytest tests

test-unit: install
	$(BIN)/python -m pytest tests/unit

test-integration: install
	$(BIN)/python -m pytest tests/integration

down: install
	$(BIN)/elastic local down

clean: down
	rm -rf $(VENV) .elastic
