"""The runnable shell blocks of README.md and docs/ (parsed by tests/unit/docs/blocks.py), run as a reader runs
them: each `<!-- runnable -->` block in a fresh bash at the repository root, `.venv/bin` first on PATH, against
one local stack made as the README's tour makes it (`elastic local up`), in page order; it must exit 0 and print
every `<!-- expect: TEXT -->` line it states.

Marked `docs`, so `make test` leaves them out (to hold CI's time) and
`make test-docs` runs them. The `<!-- runnable: stack -->` blocks start and stop stacks of their own (one is
`make test` itself); `ELASTIC_DOCS_STACK_BLOCKS=1` runs those too, each after a `local down`, except the ones
that run the test suite.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.unit.docs.blocks import all_blocks

pytestmark = [pytest.mark.integration, pytest.mark.docs]

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SECONDS = 900
RUNS_THE_SUITE = ("make test", "pytest tests ")  # blocks that run this very suite: never from inside it


def runnable(own_stack: bool) -> list:
    blocks = [b for b in all_blocks() if b.runnable and b.needs_own_stack == own_stack]
    if own_stack:
        blocks = [b for b in blocks if not any(word in b.text for word in RUNS_THE_SUITE)]
    return [pytest.param(b, id=b.where) for b in blocks]


@pytest.fixture(scope="module")
def reader(tmp_path_factory, cli_factory):
    """A reader's shell environment with the module's own stack up (its ELASTIC_HOME, its token)."""
    cli = cli_factory(tmp_path_factory.mktemp("elastic-home-docs"))
    env = dict(cli.env)
    env["PATH"] = f"{ROOT / '.venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    up = cli.run("local", "up", "--json", check=True, timeout=300)
    assert json.loads(up.stdout)["nodes"]
    yield env
    cli.run("local", "down", timeout=180)


def run_block(block, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.text],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=BLOCK_SECONDS,
    )


def check(block, proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{block.text}\n{proc.stdout[-4000:]}"
    missing = block.missing_expectations(proc.stdout)
    assert not missing, f"{block.where}: no output line holds {missing}:\n{proc.stdout[-4000:]}"


@pytest.mark.parametrize("block", runnable(own_stack=False))
def test_a_runnable_block_runs_against_the_stack(block, reader):
    check(block, run_block(block, reader))


@pytest.mark.skipif(os.environ.get("ELASTIC_DOCS_STACK_BLOCKS") != "1", reason="ELASTIC_DOCS_STACK_BLOCKS=1 runs them")
@pytest.mark.parametrize("block", runnable(own_stack=True))
def test_a_block_that_makes_its_own_stack_runs(block, reader):
    check(block, run_block(block, reader))
    subprocess.run(["elastic", "local", "down"], cwd=ROOT, env=reader, capture_output=True, timeout=180)
