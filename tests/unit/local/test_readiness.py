"""A node whose `ray start` gave up registering (Ray's fixed 30 s window, missed under load) is told apart at
once from one that is merely slow, so the stack starts it again instead of waiting out the whole timeout."""

from __future__ import annotations

import time

import pytest

from elastic.local import readiness
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
