"""moto's server for integration tests: a real AWS HTTP endpoint on 127.0.0.1, with the standard AWS variables
pointing at it in os.environ while it runs (restored afterwards)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

# Variables that would send boto3/s3fs elsewhere or pick up a developer's own credentials.
AWS_VARIABLES_TO_CLEAR = (
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL_EC2",
    "AWS_ENDPOINT_URL_IAM",
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
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


@contextmanager
def running_moto(
    log_dir: Path, region: str = "us-east-1", server_env: dict | None = None, extra: dict | None = None
) -> Iterator[dict]:
    """Start moto_server, set the AWS environment to it (plus `extra`), yield that environment."""
    port = free_port()
    binary = Path(sys.executable).parent / "moto_server"
    with open(log_dir / "moto.log", "wb") as log:
        proc = subprocess.Popen(
            [str(binary), "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(server_env or {})},
        )
    try:
        wait_for_port(port, proc)
        env = {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": region,
            "AWS_EC2_METADATA_DISABLED": "true",
            **(extra or {}),
        }
        # Module-scoped fixtures use this, where pytest's function-scoped monkeypatch cannot be used.
        with pytest.MonkeyPatch.context() as patch:
            for name in AWS_VARIABLES_TO_CLEAR:
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
