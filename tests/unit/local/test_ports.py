"""The local stack's port picking: distinct ports, free ones, outside the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket

import pytest

from elastic.local import ports


@pytest.fixture(autouse=True)
def fresh_handed_out(monkeypatch):
    monkeypatch.setattr(ports, "_handed_out", set())


def test_ports_come_from_between_rays_worker_ports_and_the_ephemeral_range():
    low, _ = ports.ephemeral_range()
    drawn = [ports.free_port() for _ in range(50)]
    assert len(set(drawn)) == 50
    if len(ports.listener_range()):
        assert all(ports.LISTENER_LOW <= port < low for port in drawn)


def test_the_ephemeral_range_is_read_from_the_kernel_setting(tmp_path):
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t60999\n")
    assert ports.ephemeral_range(setting) == (40000, 60999)
    assert ports.ephemeral_range(tmp_path / "absent") == (32768, 60999)
    assert ports.listener_range((40000, 60999)) == range(20000, 40000)
    # an ephemeral range widened down to Ray's ports leaves no room: bind to port 0 instead
    assert len(ports.listener_range((20500, 65535))) == 0


def test_a_port_someone_listens_on_or_handed_out_before_is_not_handed_out(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        monkeypatch.setattr(ports, "listener_range", lambda: range(taken, taken + 50))
        draws = iter([taken, taken + 1, taken + 1, *range(taken + 2, taken + 50)])

        class Scripted(random.Random):
            def choice(self, seq):
                return next(draws)

        first = ports.free_port(Scripted())
        second = ports.free_port(Scripted())
    assert taken not in (first, second) and first != second


def test_with_no_room_between_the_ranges_the_kernel_chooses(monkeypatch):
    monkeypatch.setattr(ports, "listener_range", lambda: range(0))
    drawn = {ports.free_port() for _ in range(5)}
    assert len(drawn) == 5 and all(port > 0 for port in drawn)
