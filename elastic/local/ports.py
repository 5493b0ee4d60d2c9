"""Ports for the local stack's listeners, chosen where nothing else on the machine picks its own.

The kernel hands the ports of its ephemeral range (`ip_local_port_range`, 32768-60999 by default) to every
outgoing connection and to every bind to port 0, and Ray gives its workers 10002-19999. A port probed free in
the ephemeral range can be some connection's local port a moment later, before our daemon binds it: seen in
CI with two stacks busy beside each other, SeaweedFS's filer exiting with "bind: address already in use". So
our listeners' ports come from between the two ranges, where only a process that names a port binds one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LISTENER_LOW = 20000  # above Ray's default worker ports (--min-worker-port 10002 .. --max-worker-port 19999)
MIN_LISTENER_PORTS = 1000  # fewer between the two ranges (a widened ephemeral range): bind to port 0 instead
_EPHEMERAL_DEFAULT = (32768, 60999)

_handed_out: set[int] = set()  # ports given to daemons by this process, bound by them later or not yet


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; the default elsewhere)."""
    try:
        low, high = (int(part) for part in path.read_text().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def listener_range(ephemeral: tuple[int, int] | None = None) -> range:
    """Where our listeners' ports are drawn from: above Ray's worker ports, below the ephemeral range
    (empty when the two leave fewer than MIN_LISTENER_PORTS between them)."""
    low, _ = ephemeral or ephemeral_range()
    chosen = range(LISTENER_LOW, low)
    return chosen if len(chosen) >= MIN_LISTENER_PORTS else range(0)


def port_is_free(port: int) -> bool:
    """Whether a listener could bind this loopback port now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(draw: random.Random | None = None) -> int:
    """A loopback port free now, outside the ephemeral range, and never handed out before by this process
    (two components of one node were once given the same port: Ray refused to start, "metrics_export is
    trying to use a port number ... that is used by other components"). Random, so that two stacks starting
    at once rarely draw the same one."""
    draw = draw or random.SystemRandom()
    ports = listener_range()
    for _ in range(len(ports) and 1000):
        port = draw.choice(ports)
        if port not in _handed_out and port_is_free(port):
            _handed_out.add(port)
            return port
    while True:  # no room between the ranges (or it is full): the kernel's choice, as before
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
