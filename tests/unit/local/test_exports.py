"""Unit tests for elastic/local/exports.py: a shell's exports of a stack that is gone are told apart from those
of the running stack, and dropped so they steer nothing; and for the state-file cases `up` cleans first."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from elastic.local import exports, stack
from elastic.local.readiness import ray_clients_at
from elastic.local.state import ENV_MARKER_VARIABLE, STACK_VARIABLES, LocalState, save_state


def _state(marker: str = "abc123def456", gcs: int = 6379, dashboard: int = 8265) -> LocalState:
    return LocalState(
        marker=marker,
        temp_dir="/tmp/none",
        ray_address=f"127.0.0.1:{gcs}",
        dashboard_url=f"http://127.0.0.1:{dashboard}",
        s3_endpoint="http://127.0.0.1:9000",
        bucket="elastic",
        logical_gpus=False,
        auth_token_path="/home/u/.elastic/local/auth_token",
    )


def test_exports_of_the_running_stack_are_not_stale():
    state = _state()
    assert exports.stale_exports(state.env(), state, listening=lambda h, p: False) == {}


def test_exports_with_another_stacks_marker_are_all_stale():
    old, new = _state("old000000000"), _state("new000000000", gcs=7000, dashboard=7001)
    stale = exports.stale_exports({**old.env(), "HOME": "/root"}, new, listening=lambda h, p: True)
    assert set(stale) == set(old.env())  # every stack variable, nothing of the user's
    assert stale["RAY_ADDRESS"] == old.ray_address


def test_exports_with_a_marker_and_no_stack_running_are_stale():
    assert "RAY_API_SERVER_ADDRESS" in exports.stale_exports(_state().env(), None, listening=lambda h, p: True)


def test_unmarked_exports_are_stale_only_where_nothing_listens_on_loopback():
    env = {
        "RAY_ADDRESS": "127.0.0.1:6379",
        "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:8265",
        "AWS_ENDPOINT_URL": "https://s3.us-east-1.amazonaws.com",  # a real endpoint: never judged here
    }
    dead = exports.stale_exports(env, None, listening=lambda h, p: False)
    assert dead == {"RAY_ADDRESS": "127.0.0.1:6379", "RAY_API_SERVER_ADDRESS": "http://127.0.0.1:8265"}
    assert exports.stale_exports(env, None, listening=lambda h, p: True) == {}
    assert exports.stale_exports({"RAY_ADDRESS": "10.0.0.5:6379"}, None, listening=lambda h, p: False) == {}
    assert exports.stale_exports({"RAY_ADDRESS": "auto"}, None, listening=lambda h, p: False) == {}


def test_the_real_probe_tells_a_listening_port_from_a_closed_one():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert exports.stale_exports({"RAY_ADDRESS": f"127.0.0.1:{port}"}, None) == {}
    assert exports.stale_exports({"RAY_ADDRESS": f"127.0.0.1:{port}"}, None) == {"RAY_ADDRESS": f"127.0.0.1:{port}"}


def test_forget_stale_drops_them_from_this_process_and_says_so_once(monkeypatch):
    old = _state("old000000000")
    for key, value in old.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("UNRELATED", "kept")
    said = []
    dropped = exports.forget_stale(None, "run eval again", warn=said.append)
    assert set(dropped) == set(old.env())
    assert not any(k in os.environ for k in old.env())
    assert os.environ["UNRELATED"] == "kept"
    assert len(said) == 1 and "RAY_ADDRESS=127.0.0.1:6379" in said[0] and said[0].endswith("run eval again")


def test_unset_lines_remove_every_exported_variable_in_a_shell():
    state = _state()
    script = "\n".join([*(f"export {k}={v}" for k, v in state.env().items()), *exports.unset_lines(), "env"])
    env = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env={}, check=True).stdout
    assert not any(line.split("=")[0] in STACK_VARIABLES for line in env.splitlines())
    assert ENV_MARKER_VARIABLE in state.env()


def test_ray_clients_at_points_rays_address_variables_at_the_stack_for_a_block(monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:1")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    state = _state()
    with ray_clients_at(state):
        assert os.environ["RAY_API_SERVER_ADDRESS"] == state.dashboard_url
        assert os.environ["RAY_ADDRESS"] == state.ray_address
    assert os.environ["RAY_API_SERVER_ADDRESS"] == "http://127.0.0.1:1"
    assert "RAY_ADDRESS" not in os.environ


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path))
    return tmp_path


def test_a_stack_whose_up_was_killed_half_way_is_not_running(home):
    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        import psutil

        from elastic.local.processes import Launched, start_ticks

        root = Launched(head.pid, psutil.Process(head.pid).create_time(), "head", start_ticks(head.pid))
        state = _state()
        state.roots = [root.to_dict()]
        state.complete = False
        save_state(state)
        assert stack.running_state() is None  # not handed out to verbs
        assert stack.status() == {"running": False, "starting": True}
        state.complete = True
        save_state(state)
        assert stack.running_state() is not None
    finally:
        head.kill()
        head.wait()


def test_down_cleans_a_state_file_left_by_a_reboot(home, tmp_path):
    temp = tmp_path / "ray-temp"
    temp.mkdir()
    state = _state()
    state.temp_dir = str(temp)
    # Processes of a boot that is over: a PID that may exist now, with a start time that cannot match.
    state.roots = [{"pid": os.getpid(), "create_time": 1.0, "role": "head", "start_ticks": 1}]
    save_state(state)
    assert stack.running_state() is None
    assert stack.down() == 0  # nothing of ours to stop; this test process is untouched
    assert not temp.exists() and stack.load_state() is None
