"""The local stack's port picking: distinct ports even when the kernel offers one again."""

from __future__ import annotations

import socket

from elastic.local import stack as local


class _ReusingSocket:
    """A socket whose bind(port 0) gets ports from a fixed sequence, as a kernel recycling ports might."""

    offers: list[int] = []

    def __init__(self, *args):
        self._port = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def bind(self, address):
        self._port = self.offers.pop(0)

    def getsockname(self):
        return ("127.0.0.1", self._port)


def test_a_port_offered_twice_is_handed_out_once(monkeypatch):
    monkeypatch.setattr(local, "_handed_out", set())
    monkeypatch.setattr(_ReusingSocket, "offers", [40001, 40001, 40001, 40002])
    monkeypatch.setattr(socket, "socket", _ReusingSocket)
    assert [local.free_port(), local.free_port()] == [40001, 40002]


def test_real_ports_are_distinct():
    ports = [local.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
