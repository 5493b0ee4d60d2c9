"""Integration fixtures: a real local stack (Ray head + spot/on-demand raylets + moto S3), once per module.

Each module gets its own ELASTIC_HOME, so a stack a developer has running is never touched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


@dataclass
class Cli:
    env: dict

    def run(self, *args: str, timeout: float = 600, check: bool = False) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "elastic", *args], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"elastic {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc


def make_cli(home: Path) -> Cli:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "AWS_")) and k != "ELASTIC_HOME"}
    env["ELASTIC_HOME"] = str(home)
    return Cli(env)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """`elastic local up --spot 2 --on-demand 1 --json` for the module; `local down` afterwards."""
    cli = make_cli(tmp_path_factory.mktemp("elastic-home"))
    up = cli.run("local", "up", "--spot", "2", "--on-demand", "1", "--json", check=True, timeout=300)
    info = json.loads(up.stdout)
    info["cli"] = cli
    yield info
    cli.run("local", "down", timeout=120)


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


_AWS_VARIABLES_TO_CLEAR = ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                           "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    import socket
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with status {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not listen on port {port} within {timeout:.0f} s")


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """moto's S3 server for the module, with the standard AWS variables pointing at it in os.environ
    (restored afterwards). Yields that environment; buckets are the test's to create."""
    port = _free_port()
    binary = Path(sys.executable).parent / "moto_server"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(port, proc)
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }
        # Module-scoped, so pytest's function-scoped monkeypatch cannot be used; the context restores all.
        with pytest.MonkeyPatch.context() as patch:
            for name in _AWS_VARIABLES_TO_CLEAR:
                patch.delenv(name, raising=False)
            for name, value in env.items():
                patch.setenv(name, value)
            yield env
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()
