"""`elastic cluster rehearse`: the AWS and GCP configs' own node commands, played on this host.

Each rehearsal installs the checkout into a venv in a fresh HOME (the config's setup_commands), starts
the head, one spot and one on-demand worker with the config's start commands (its systemd units under the
rehearsal's stand-ins), submits digits_ddp through the job API with token auth, reclaims the spot node through
its metadata server, and the run must finish with nothing lost. Afterwards nothing it started is left.
The two rehearsals share one venv (`--venv`, made as the configs' own command makes it): the first one's pip
install of the checkout brings torch and Ray, the second one's finds them (minutes of CI time saved)."""

from __future__ import annotations

import json
import subprocess

import psutil
import pytest
from conftest import make_cli

PHASES = ["servers", "file_mounts", "head", "spot", "on-demand", "watcher", "submit", "reclaim", "finish"]


def rehearsal_processes() -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if "ELASTIC_REHEARSAL_NODE" in proc.environ():
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    path = tmp_path_factory.mktemp("rehearsal") / "elastic-venv"
    subprocess.run(["python3", "-m", "venv", str(path)], check=True, timeout=300)
    return path


@pytest.mark.parametrize("config", ["aws-spot-gpu.yaml", "gcp-spot-gpu.yaml"])
def test_a_cluster_config_boots_trains_and_survives_a_reclaim(config, tmp_path, venv):
    cli = make_cli(tmp_path / "home")
    proc = cli.run("cluster", "rehearse", f"cluster-configs/{config}", "--venv", str(venv), "--json", timeout=1500)
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    assert proc.returncode == 0, (report.get("error"), report.get("workdir"), proc.stderr[-3000:])
    assert report["ok"] and report["lost_steps"] == 0 and report["preemptions"] == 1, report
    phases = {p["name"]: p for p in report["phases"]}
    assert list(phases) == PHASES and all(p["ok"] for p in phases.values())

    # The head ran every setup command of the config, the venv created and the checkout installed by them.
    head_commands = phases["head"]["commands"]
    assert [c["exit"] for c in head_commands] == [0] * len(head_commands)
    assert any("pip install" in c["command"] for c in head_commands)
    assert phases["spot"]["labels"]["market"] == "spot" and phases["on-demand"]["labels"]["market"] == "on-demand"
    assert phases["watcher"]["restarted_after_s"] < 30  # the unit's Restart=always brought it back
    assert phases["file_mounts"]["copied"] == ["~/.ray/auth_token", "~/elastic-src/pyproject.toml",
                                               "~/elastic-src/README.md", "~/elastic-src/elastic"]  # fmt: skip
    assert any(r.startswith("--autoscaling-config dropped") for r in report["rewrites"]["head"])
    assert not any("autoscaling" in r for r in report["rewrites"]["spot"])
    assert rehearsal_processes() == []
