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
# No RAY_AUTH_MODE here: the local stack runs with Ray token auth and hands its mode and token to every process
# and client it starts (`elastic local env` prints them).

.PHONY: install prometheus demo lint test test-extended test-unit test-integration down clean peers

install: $(VENV)/.installed prometheus

# Prometheus and promtool from Debian's package: `make lint` checks the alert rules with promtool, and the
# integration tests start a Prometheus of their own (127.0.0.1, a free port). Installed when missing (as root,
# non-interactively, as CI runs); the package's own service, where an init system started it, is stopped and
# disabled so nothing is left listening on its fixed port.
prometheus:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO="sudo -n"; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends prometheus \
	  || { echo "install Prometheus (Debian: apt-get install prometheus) for promtool and the integration tests" >&2; exit 1; }; \
	  $$SUDO systemctl disable --now prometheus >/dev/null 2>&1 || $$SUDO service prometheus stop >/dev/null 2>&1 || true; \
	}

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
	promtool check rules deploy/prometheus/elastic-alerts.yml
	promtool test rules deploy/prometheus/elastic-alerts.test.yml

# Two pytest-xdist workers: each integration module whole and in order on one of them (tests/conftest.py), the
# unit tests spread over both; the log ends with the 25 slowest tests and the total time.
test: lint
	$(BIN)/python -m pytest tests -n 2 --durations=25 -m "not docs and not extended"

# The long end-to-end runs left out of `make test` to hold CI under its time limit (pytest marker `extended`):
# gpt's verify-resume, the chaos soak, the recovery bench, the AWS and GCP rehearsals, bench packing's four trials on one
# GPU, the sweep whose FSDP trial runs out of memory, the three-job pack through an OOM and a reclaim, the ASHA
# sweep killed and resumed, the Hugging Face and Ray Train sweeps, the Ray Train function's reclaims, two spot nodes reclaimed at
# once, spot-first after every spot node is lost, the resume that falls back past an unreadable checkpoint and
# verify-resume on a job that forgets its scheduler (the check that catches it is a unit test).
# `make test` checks their properties in smaller runs (test_fsdp, the digits verify-resume runs, the preemption,
# lifecycle, spot-first, kill and S3-fault tests, the shared-GPU sweeps, the cluster configs' and the rehearsal's
# unit tests), though not every combination.
test-extended: lint
	$(BIN)/python -m pytest tests -n 2 --durations=0 -m "extended and not docs"

# Every runnable shell block of README.md and docs/ against a local stack (tests/integration/test_docs_blocks.py).
test-docs: install
	$(BIN)/python -m pytest tests/integration/test_docs_blocks.py -m docs --durations=0

test-unit: install
	$(BIN)/python -m pytest tests/unit

test-integration: install
	$(BIN)/python -m pytest tests/integration

# The MosaicML Streaming peer of `elastic bench data`: a venv of its own (bench/peers/.venv-mosaic), since
# mosaicml-streaming pins numpy<2.2 and transformers<5. Without it the bench reports that peer as skipped.
peers:
	PYTHON=$(PYTHON) TORCH_SPEC='$(TORCH_SPEC)' bench/peers/setup_mosaic.sh

down: install
	$(BIN)/elastic local down

clean: down
	rm -rf $(VENV) .elastic
