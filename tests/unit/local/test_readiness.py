"""A node whose `ray start` gave up registering (Ray's fixed 30 s window, missed under load) is told apart at
once from one that is merely slow, so the stack starts it again instead of waiting out the whole timeout."""

from __future__ import annotations

import sys
import time

import pytest

from elastic.local import ports, processes, readiness
from elastic.local import stack as stack
from elastic.local.state import LocalState, NodePlan

RAY_START_TRACE = """Traceback (most recent call last):
  File "ray/_private/node.py", line 440, in __init__
    raise Exception(
Exception: The current node timed out during startup. This could happen because some of the raylet failed to startup or the GCS has become overloaded.
"""


@pytest.fixture
def state(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path))
    monkeypatch.setattr("ray.util.state.list_nodes", lambda **kwargs: [])  # a cluster where the node never shows
    return LocalState(
        marker="abc123def456",
        temp_dir="/tmp/none",
        ray_address="127.0.0.1:1",
        dashboard_url="http://127.0.0.1:2",
        s3_endpoint="http://127.0.0.1:3",
        bucket="elastic",
        logical_gpus=False,
    )


def test_a_node_whose_ray_start_timed_out_is_reported_at_once_by_name(state):
    readiness.logs_dir().mkdir(parents=True)
    (readiness.logs_dir() / "spot-6.log").write_text(RAY_START_TRACE)
    started = time.monotonic()
    with pytest.raises(readiness.NodeStartTimedOut) as raised:
        readiness.wait_for_nodes(state, [NodePlan("spot-6", "spot", "worker", 1, 0)], timeout=60)
    assert time.monotonic() - started < 10  # not the 60 s timeout
    assert raised.value.name == "spot-6"
    assert "gave up joining" in str(raised.value)


def test_a_node_that_is_only_slow_waits_out_its_timeout_with_the_plain_error(state):
    readiness.logs_dir().mkdir(parents=True)
    (readiness.logs_dir() / "spot-6.log").write_text("Local node IP: 127.0.0.1\n")
    with pytest.raises(readiness.ClusterError) as raised:
        readiness.wait_for_nodes(state, [NodePlan("spot-6", "spot", "worker", 1, 0)], timeout=2)
    assert not isinstance(raised.value, readiness.NodeStartTimedOut)
    assert "did not join within 2s" in str(raised.value)


FILER_BIND_FAILED = (
    "F1207 18:49:38.826111 filer.go:454 Filer listener error: listen tcp 127.0.0.1:49771: bind: address already in use"
)


def _exits_with_a_go_fatal(port: int) -> list[str]:
    # a fatal line, then a goroutine dump as long as Go's: the error must still name the fatal line
    script = f"echo '{FILER_BIND_FAILED}'; for i in $(seq 40); do echo \"goroutine $i [running]:\"; done; exit 1"
    return ["sh", "-c", script]


def test_a_server_that_exits_before_it_listens_is_reported_at_once_with_its_fatal_line(state, tmp_path):
    log = tmp_path / "s3.log"
    launched = processes.launch(_exits_with_a_go_fatal(1), "s3", state.marker, {}, log)
    started = time.monotonic()
    with pytest.raises(readiness.ExitedAtStart) as raised:
        readiness.wait_for_port(ports.free_port(), 60, "the local S3 server", log, launched)
    assert time.monotonic() - started < 10  # not the 60 s timeout
    assert f"fatal: {FILER_BIND_FAILED}" in str(raised.value)
    assert "goroutine 40 [running]:" in str(raised.value)  # and the last lines after it


def test_the_s3_server_is_started_again_on_other_ports_when_it_exits_before_listening(state, monkeypatch):
    attempts = []

    def command(name, port, data, free_port):
        attempts.append(port)
        if len(attempts) == 1:
            return _exits_with_a_go_fatal(port)
        return [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)]

    monkeypatch.setattr(stack.s3servers, "command", command)
    state.s3_server, state.ports = "seaweedfs", {"s3": ports.free_port()}
    logs = readiness.logs_dir()
    try:
        stack._start_s3(state, {}, logs, timeout=60)
        assert len(attempts) == 2 and set(attempts) == {state.ports["s3"]}  # the S3 port kept
        assert [r["role"] for r in state.roots] == ["s3"]  # the exited attempt no longer recorded
        assert FILER_BIND_FAILED in (logs / "s3.log.1").read_text()
    finally:
        processes.kill_trees(state.launched())
