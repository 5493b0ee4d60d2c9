"""Integration fixtures: a real local stack (Ray head + spot/on-demand raylets + moto S3), once per module.

Each module gets its own ELASTIC_HOME, so a stack a developer has running is never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from auth_helpers import use_session_token_in_this_process, write_token
from moto_helpers import running_moto

ROOT = Path(__file__).resolve().parents[2]

use_session_token_in_this_process()

pytestmark = pytest.mark.integration


@dataclass
class Cli:
    env: dict

    def run(self, *args: str, timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-m", "elastic", *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"elastic {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            )
        return proc


def make_cli(home: Path) -> Cli:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_")) and k != "ELASTIC_HOME"}
    env["ELASTIC_HOME"] = str(home)
    write_token(home / "local" / "auth_token")  # the session's token (auth_helpers), kept by `local up`
    return Cli(env)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`elastic local up --spot 2 --on-demand 1 --json` for the module; `local down` afterwards."""
    cli = make_cli(tmp_path_factory.mktemp("elastic-home"))
    up = cli.run("local", "up", "--spot", "2", "--on-demand", "1", "--json", check=True, timeout=300)
    info = json.loads(up.stdout)
    info["cli"] = cli
    with ray_auth(info["env"]):
        yield info
    cli.run("local", "down", timeout=120)


@contextmanager
def ray_auth(env: dict):
    """The stack's Ray auth (token mode, its token file) in this process's environment for a block: tests
    that call Ray's SDK themselves (state API, job client) pass the GCS's and job API's token check."""
    keys = [k for k in env if k.startswith("RAY_AUTH")]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: env[k] for k in keys})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture(scope="module")
def stack_env(stack) -> dict:
    """Environment that points boto3/s3fs/Ray at the module's stack (what `elastic local env` prints)."""
    return stack["env"]


@pytest.fixture(scope="session")
def cli_factory():
    """make_cli(home) for tests (and module fixtures) that run a stack of their own."""
    return make_cli


# ---------------------------------------------------------------------------------------------------------
# A bare S3 endpoint (no Ray) for storage-level tests


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """moto's S3 server for the module, with the standard AWS variables pointing at it in os.environ
    (restored afterwards). Yields that environment; buckets are the test's to create."""
    with running_moto(tmp_path_factory.mktemp("moto")) as env:
        yield env
