"""`elastic cluster rehearse`: the AWS and GCP configs' own node commands, played on this host.

Each rehearsal installs the checkout into a venv in a fresh HOME (the config's setup_commands), starts
the head, one spot and one on-demand worker with the config's start commands (its systemd units under the
rehearsal's stand-ins), submits digits_ddp through the job API with token auth, reclaims the spot node through
its metadata server, and the run must finish with nothing lost. Afterwards nothing it started is left.
The two rehearsals share one venv (`--venv`, a machine image's baked-in venv): a clone of this test run's own
venv, so the configs' `pip install` of the checkout finds torch and Ray at their pinned versions and installs
elastic itself, as on an image with its dependencies baked in (minutes of CI time saved; a clean resolve of the
same pyproject from nothing is `make install`'s, at the start of every CI run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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
    if sys.prefix == sys.base_prefix:  # not run from a venv: a fresh one, which the first rehearsal fills
        subprocess.run(["python3", "-m", "venv", str(path)], check=True, timeout=300)
    else:
        clone_venv(Path(sys.prefix), path)
    return path


def clone_venv(source: Path, target: Path) -> None:
    """A copy of the venv at `source` made of hard links (seconds, no disk; pip and Python replace files rather
    than write into them, so the source never changes), less its editable install of elastic, with every file
    naming `source` (script shebangs, activate) rewritten as a new file naming `target`."""
    editable = ("__editable__", "elastic_train-")
    site = next((source / "lib").glob("python3*/site-packages"))
    ignore = lambda folder, names: [n for n in names if Path(folder) == site and n.startswith(editable)]  # noqa: E731
    shutil.copytree(source, target, symlinks=True, copy_function=os.link, ignore=ignore)
    old, new = str(source).encode(), str(target).encode()
    for script in (target / "bin").iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        content = script.read_bytes()
        if old in content:
            mode = script.stat().st_mode
            script.unlink()  # a new file: writing through the hard link would change the source's
            script.write_bytes(content.replace(old, new))
            script.chmod(mode)
    (target / "pyvenv.cfg").unlink()
    (target / "pyvenv.cfg").write_text((source / "pyvenv.cfg").read_text().replace(str(source), str(target)))


# make test-extended: each rehearsal boots a third Ray cluster beside the two stacks of a CI run. make test checks
# the configs themselves (tests/unit/clusterconfig) and the rehearsal's parts (tests/unit/rehearsal).
@pytest.mark.extended
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
