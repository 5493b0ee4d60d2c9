# The README's two commands: `make demo` and `make test`. Each builds .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch, pinned here (not in pyproject) so the install stays small on CPU machines;
# override on a GPU box, e.g. `make install TORCH_SPEC='torch==2.13.0'` from the CUDA index.
TORCH_SPEC ?= torch==2.13.0
# The oldest pip seen to install '.[dev]' (25.0.1 and 25.1.1 did): 23.2, the pip of a fresh Python 3.11 venv,
# takes the newest boto3 first, finds no aiobotocore (s3fs) that accepts its botocore, backtracks through every
# aiobotocore and s3fs instead of an older boto3, and gives up with ResolutionImpossible.
MIN_PIP := 25.0
# One auth mode for every Ray process, driver and CLI call of the local stack (README: Development notes).
export RAY_AUTH_MODE ?= disabled

.PHONY: install demo lint test test-unit test-integration down clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade 'pip>=$(MIN_PIP)'
	$(BIN)/python -c "import pip, sys; v = tuple(int(p) for p in pip.__version__.split('.')[:2]); \
	sys.exit(0 if v >= tuple(int(p) for p in '$(MIN_PIP)'.split('.')) else \
	f'pip {pip.__version__} in $(VENV) is older than $(MIN_PIP); run: $(BIN)/python -m pip install -U pip')"
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
