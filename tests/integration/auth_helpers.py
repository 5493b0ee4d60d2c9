"""One Ray token for every cluster of this test session, made at run time (never stored in the repository).

Each local stack keeps its token in its own home and the watcher test's cluster in its temp dir; Ray's client
in the pytest process reads the token once and caches it, so they all hold the same one.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path

SESSION_TOKEN = secrets.token_hex(32)


def write_token(path: Path) -> Path:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(SESSION_TOKEN)
        path.chmod(0o600)
    return path


def use_session_token_in_this_process() -> None:
    """Token mode and the session's token for Ray's client in the pytest process, before anything initialises
    Ray's config here (it reads RAY_AUTH_MODE once): every cluster the tests start accepts it."""
    folder = Path(tempfile.mkdtemp(prefix="elastic-test-token-"))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(write_token(folder / "auth_token")))
