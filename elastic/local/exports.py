"""What a shell holds from `eval "$(elastic local env)"`, and telling when those exports belong to a stack
that is gone.

After `elastic local down` and a new `elastic local up`, a shell that evaluated the old stack's exports still
points RAY_ADDRESS, RAY_API_SERVER_ADDRESS and AWS_ENDPOINT_URL at ports nobody listens on. Ray lets those
variables win over an address passed in code (`ray.util.state.list_nodes(address=...)` asks
RAY_API_SERVER_ADDRESS first), so they must never steer the commands that start or use the new stack.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from urllib.parse import urlsplit

from elastic.local.state import ADDRESS_VARIABLES, ENV_MARKER_VARIABLE, STACK_VARIABLES, LocalState

_log = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def stale_exports(environ: Mapping[str, str], running: LocalState | None, listening=None) -> dict[str, str]:
    """The stack variables in `environ` that belong to a local stack other than `running` (None: none runs).

    Exports carrying ELASTIC_LOCAL_ENV are stale when that marker is not the running stack's. Older exports
    (no marker) are stale where an address variable names a loopback port that nothing listens on: no
    local stack or server is there any more. `listening(host, port)` is the probe (a TCP connect)."""
    listening = listening or _listening
    present = {k: environ[k] for k in STACK_VARIABLES if environ.get(k)}
    marker = environ.get(ENV_MARKER_VARIABLE)
    if marker:
        if running is not None and marker == running.marker:
            return {}
        return present
    stale = {}
    for name in ADDRESS_VARIABLES:
        endpoint = _loopback_endpoint(environ.get(name, ""))
        if endpoint is not None and not listening(*endpoint):
            stale[name] = environ[name]
    return stale


def forget_stale(running: LocalState | None, advice: str, warn=None) -> dict[str, str]:
    """Drop this process's stale stack exports (see stale_exports) and say so once, through `warn` (default:
    a logged warning; the CLI passes one that writes to stderr, keeping --json output clean)."""
    stale = stale_exports(os.environ, running)
    if stale:
        (warn or _log.warning)(f"{describe(stale)}: ignored; {advice}")
        for name in stale:
            os.environ.pop(name, None)
    return stale


def unset_lines(environ: Mapping[str, str] | None = None) -> list[str]:
    """Shell lines that remove what `elastic local env` exported (all of it when `environ` is None)."""
    names = [k for k in STACK_VARIABLES if environ is None or k in environ]
    return [f"unset {' '.join(names)}"] if names else []


def describe(stale: Mapping[str, str]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in stale.items() if k in ADDRESS_VARIABLES) or ", ".join(stale)
    return f"this shell exports variables of a local stack that is gone ({shown})"


def _loopback_endpoint(value: str) -> tuple[str, int] | None:
    """(host, port) of a loopback address such as 127.0.0.1:6379 or http://127.0.0.1:8265, else None."""
    if not value:
        return None
    parts = urlsplit(value if "://" in value else f"tcp://{value}")
    try:
        port = parts.port
    except ValueError:
        return None
    if parts.hostname not in LOOPBACK_HOSTS or port is None:
        return None
    return parts.hostname, port


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0
