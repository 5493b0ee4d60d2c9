"""`elastic chaos soak` on a real local stack with its S3 fault proxy (--s3-faults) and two spot nodes: a short
soak of six faults of six kinds (seed 3: a kill inside a save, S3 errors during a save and during a restore, a
worker kill, a killed and resubmitted driver, two correlated reclaims). Equivalence, not survival: bit-identical
final state, every sample once per epoch, no torn checkpoint loaded, every fault fired. Then hygiene: nothing
of the run is left behind (processes, Ray actors, placement groups, temporary files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import ROOT, make_cli

pytestmark = pytest.mark.integration

EPOCHS = 30  # 690 steps at 2 workers, a checkpoint every 50: room for six faults with recoveries between

# What Ray still holds for the run, asked of its state API from the stack's environment.
RAY_LEFTOVERS = """
import json, sys
from ray.util.state import list_actors, list_placement_groups
address = sys.argv[1]
actors = list_actors(address=address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False, limit=1000)
groups = list_placement_groups(address=address, raise_on_missing_output=False, limit=1000)
print(json.dumps({
    "actors": [a.class_name for a in actors if "Train" in (a.class_name or "")],
    "groups": [g.placement_group_id for g in groups if g.state != "REMOVED"],
}))
"""


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cli = make_cli(tmp_path_factory.mktemp("elastic-home"))
    up_args = ("local", "up", "--spot", "2", "--on-demand", "1", "--s3-faults", "--json")
    try:
        # Nodes join within `up`'s 120 s on a quiet machine; a saturated one may need a second start.
        up = cli.run(*up_args, timeout=400)
        if up.returncode != 0:
            cli.run("local", "down", timeout=180)
            up = cli.run(*up_args, check=True, timeout=400)
        info = json.loads(up.stdout)
        info["cli"] = cli
        yield info
    finally:
        cli.run("local", "down", timeout=180)


@pytest.mark.extended  # the soak; make test asserts each of its faults' recoveries in a test of its own
@pytest.mark.timeout(1600)  # the soak's own limit is 1500 s: seen over 900 s on a loaded CI machine
def test_a_short_soak_passes_and_leaves_nothing_of_the_run_behind(stack, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    cli = make_cli(Path(stack["cli"].env["ELASTIC_HOME"]))
    cli.env["TMPDIR"] = str(scratch)  # the soak's own temporary files, if any, land here
    proc = cli.run(
        "chaos",
        "soak",
        "jobs/digits_ddp.yaml",
        "--faults",
        "6",
        "--seed",
        "3",
        "--set",
        f"config.epochs={EPOCHS}",
        "--json",
        timeout=1500,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads(proc.stdout)
    assert report["faults_fired"] == report["faults_planned"] == 6, report["faults"]
    assert {f["kind"] for f in report["faults"]} == {
        "save_kill",
        "s3_save_errors",
        "s3_restore_errors",
        "worker_kill",
        "driver_killed",
        "correlated_reclaims",
    }
    assert report["identical"] is True and report["max_abs_diff"] == 0.0
    assert report["samples_exactly_once"] is True
    assert report["torn_loaded"] == 0
    assert report["lost_steps_noticed"] == 0  # the correlated reclaims came with notice: just-in-time saves
    assert 0 < report["goodput"] <= 1
    assert report["restarts"] >= 5 and len(report["job_ids"]) == 2  # the driver kill resubmitted once
    assert report["passed"] is True and report["problems"] == []

    # Hygiene: every job of the run ended, and nothing of it is left running or allocated.
    rows = json.loads(cli.run("status", "--json", check=True).stdout)
    statuses = {row["job_id"]: row["status"] for row in rows if row["job_id"] in report["job_ids"]}
    assert statuses == {report["job_ids"][0]: "STOPPED", report["job_ids"][1]: "SUCCEEDED"}
    leftovers = subprocess.run(
        [sys.executable, "-c", RAY_LEFTOVERS, stack["dashboard_url"]],
        env={**cli.env, **stack["env"]},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert json.loads(leftovers.stdout) == {"actors": [], "groups": []}
    run = report["faulted_run"]
    drivers = [p.pid for p in psutil.process_iter(["cmdline"]) if run in " ".join(p.info["cmdline"] or [])]
    assert drivers == [], f"processes of {run} still running: {drivers}"
    # torch makes its per-user compile cache folder (torchinductor_USER) at import, empty: not a file of the run.
    assert [p for p in scratch.rglob("*") if not p.is_dir()] == []
