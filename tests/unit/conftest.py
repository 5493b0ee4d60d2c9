"""Fixtures shared by the unit tests."""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from dataclasses import dataclass

import pytest


@dataclass
class Finished:
    returncode: int
    stderr: str


def run_cli_entry(*args: str) -> Finished:
    """`elastic ARGS` through the real entry, main() (one line and exit 2 for user errors), in this process."""
    cli_main = importlib.import_module("elastic.cli.main")  # elastic.cli re-exports main(), the function
    err = io.StringIO()
    code = 0
    argv = sys.argv
    try:
        sys.argv = ["elastic", *args]
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli_main.main()
    except SystemExit as exit_:
        code = exit_.code or 0
    finally:
        sys.argv = argv
    return Finished(code, err.getvalue())


@pytest.fixture
def cli_entry():
    return run_cli_entry
