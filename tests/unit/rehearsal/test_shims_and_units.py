"""The rehearsal's stand-ins for sudo, apt-get and systemd: real processes, supervised as systemd would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from elastic.rehearsal import shims


@pytest.fixture
def host(tmp_path, monkeypatch):
    bin_dir = shims.install(tmp_path / "bin")
    env = {
        "PATH": os.pathsep.join([str(bin_dir), shims.SYSTEM_PATH]),
        "HOME": str(tmp_path),
        shims.STATE_VARIABLE: str(tmp_path / "state"),
        "ELASTIC_METADATA_URL": "http://127.0.0.1:9",  # passed on to units
        "SOMETHING_ELSE": "not for units",
    }
    (tmp_path / "state").mkdir()
    yield tmp_path, env
    # Stop whatever a test left running.
    for pid_file in (tmp_path / "state" / "units").glob("*.pid"):
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sh(env, command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=60)


def wait_for(check, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    return check()


def unit_state(tmp_path, unit):
    try:
        return json.loads((tmp_path / "state" / "units" / f"{unit}.state.json").read_text())
    except (OSError, ValueError):
        return None


def test_sudo_runs_the_command_with_its_variables(host):
    _, env = host
    out = sh(env, "sudo DEBIAN_FRONTEND=noninteractive sh -c 'echo $DEBIAN_FRONTEND'")
    assert out.returncode == 0 and out.stdout.strip() == "noninteractive"
    assert sh(env, "sudo false").returncode == 1


def test_apt_get_and_cloud_init_are_logged_and_skipped(host):
    tmp_path, env = host
    assert (
        sh(
            env, "sudo apt-get -o DPkg::Lock::Timeout=600 install -y python3-venv && cloud-init status --wait"
        ).returncode
        == 0
    )
    log = (tmp_path / "state" / "shims.log").read_text()
    assert "apt-get -o DPkg::Lock::Timeout=600 install -y python3-venv: skipped" in log and "cloud-init" in log


def test_a_unit_is_restarted_after_a_kill_and_its_exec_stop_runs_on_stop(host):
    tmp_path, env = host
    out_file = tmp_path / "out.log"
    stopped = tmp_path / "stopped"
    started = sh(
        env,
        'sudo systemd-run --unit=watcher --collect --uid="$(id -u)" -p Restart=always -p RestartSec=0.2 '
        f"-p StandardOutput=append:{out_file} -p ExecStop=\"/bin/bash -c 'echo $ELASTIC_METADATA_URL > {stopped}'\" "
        '--setenv=LABELS=\'{"market":"spot"}\' '
        "/bin/bash -c 'echo \"start $LABELS $ELASTIC_METADATA_URL ${SOMETHING_ELSE:-clean}\"; exec sleep 60'",
    )
    assert started.returncode == 0, started.stderr
    first = wait_for(lambda: unit_state(tmp_path, "watcher"))
    assert first and first["starts"] == 1
    assert sh(env, "systemctl is-active watcher").returncode == 0

    os.kill(first["pid"], signal.SIGKILL)  # what a crash looks like
    second = wait_for(lambda: (s := unit_state(tmp_path, "watcher")) and s["starts"] == 2 and s)
    assert second and second["pid"] != first["pid"]

    assert sh(env, "sudo systemctl stop watcher").returncode == 0
    assert stopped.read_text().strip() == "http://127.0.0.1:9"  # ExecStop ran, in the unit's environment
    assert wait_for(lambda: sh(env, "systemctl is-active watcher").returncode == 3)
    # A unit's environment: its --setenv and the host's stand-ins, nothing else of the caller's.
    assert 'start {"market":"spot"} http://127.0.0.1:9 clean' in out_file.read_text()
    assert sh(env, "systemctl is-system-running").stdout.strip() == "running"


def test_a_unit_without_restart_stays_down(host):
    tmp_path, env = host
    assert sh(env, "systemd-run --unit=once /bin/true").returncode == 0
    assert wait_for(lambda: sh(env, "systemctl is-active once").returncode == 3)
    assert unit_state(tmp_path, "once")["starts"] == 1
