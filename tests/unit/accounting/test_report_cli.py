"""`elastic report` on a ledger written to a local run folder: the JSON keys and figures, the PNG, a sweep's
allocation, and one-line errors for a missing ledger or a bad price file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_goodput_and_cost import noticed_reclaim

from elastic.ledger import LedgerWriter
from elastic.ledger.events import (
    PlacementEnded,
    PlacementStarted,
    RunEnded,
    RunStarted,
    Steps,
    SweepEnded,
    SweepStarted,
    WorkersStarted,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_ledger(folder, events) -> str:
    writer = LedgerWriter(str(folder), "test", flush_seconds=60)
    for event in events:
        writer.record(event)
    writer.close()
    return str(folder)


def elastic(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "ELASTIC_HOME": "/nonexistent"}
    return subprocess.run(
        [sys.executable, "-m", "elastic", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_run_report_json_and_png(tmp_path):
    run = write_ledger(tmp_path / "runs" / "r", noticed_reclaim())
    png = tmp_path / "r.png"
    proc = elastic("report", run, "--json", "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["goodput"] == pytest.approx(49 / 72, abs=1e-4)
    assert report["productive_s"] + sum(report["badput"].values()) == pytest.approx(report["wall_s"])
    assert report["preemptions"] == 1 and report["lost_steps"] == 0
    (reclaim,) = report["preemption_details"]
    assert (reclaim["step_at_notice"], reclaim["just_in_time_step"], reclaim["node_died"]) == (90, 100, 50.0)
    assert (reclaim["resumed_at"], reclaim["resumed_from_step"], reclaim["steps_lost"]) == (47.0, 100, 0)
    assert set(report["gpu_hours"]) == {"spot", "on-demand"} and report["gpu_hours"]["spot"] > 0
    assert report["cost"]["savings"] == pytest.approx(report["cost"]["all_on_demand"] - report["cost"]["actual"])
    assert [(p["id"], p["ended_by"]) for p in report["placements"]] == [("p1", "preemption"), ("p2", "finished")]
    assert png.read_bytes()[:8] == PNG_MAGIC

    text = elastic("report", run)
    assert text.returncode == 0 and "goodput 0.681" in text.stdout and "preemption 1: notice" in text.stdout


def test_sweep_report_counts_allocation_not_utilization(tmp_path):
    experiment = tmp_path / "sweeps" / "s"
    (experiment).mkdir(parents=True)
    (experiment / "elastic-sweep.json").write_text("{}")
    write_ledger(
        experiment,
        [
            SweepStarted(0.0, sweep="s", gpus_available=1.0, share=0.25, num_samples=2),
            SweepEnded(
                100.0,
                trials=[
                    {"trial_id": "a", "run_name": "s-a", "state": "TERMINATED", "gpu_share": 0.25, "metric": 0.5},
                    {"trial_id": "b", "run_name": "s-b", "state": "STOPPED", "gpu_share": 0.25, "metric": 0.9},
                ],
            ),
        ],
    )
    for name, (start, end) in {"s-a": (0.0, 100.0), "s-b": (0.0, 50.0)}.items():
        node = {"node_id": "n", "market": "spot", "instance_type": "g5.xlarge", "node_cpus": 2, "node_gpus": 1}
        write_ledger(
            experiment / "train" / name,
            [
                RunStarted(start, run=name, kind_of_run="trial"),
                PlacementStarted(start, placement="", market="spot", workers=1, gpus_per_worker=0.25),
                WorkersStarted(start + 1, attempt=name, world_size=1, gpus_per_worker=0.25, nodes=[node]),
                Steps(start + 2, attempt=name, ended=end - 1, first_step=1, last_step=10),
                PlacementEnded(end, placement="", ended_by="finished"),
                RunEnded(end, status="SUCCEEDED"),
            ],
        )
    png = tmp_path / "s.png"
    proc = elastic("report", str(experiment), "--json", "--png", str(png))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["trials_by_state"] == {"TERMINATED": 1, "STOPPED": 1}
    assert report["allocation"] == pytest.approx((0.25 * 100 + 0.25 * 50) / (1.0 * 100))
    assert report["gpu_hours"]["spot"] == pytest.approx(0.25 * 150 / 3600, abs=1e-6)
    assert report["trials_per_gpu_hour"] == pytest.approx(2 / (0.25 * 150 / 3600), rel=1e-3)
    assert report["allocation_over_time"][0] == (0.0, 0.5) or report["allocation_over_time"][0] == [0.0, 0.5]
    assert "not utilization" in report["allocation_note"]
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_no_ledger_and_a_bad_price_file_are_one_line_and_exit_2(tmp_path):
    proc = elastic("report", str(tmp_path / "nothing"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "no run ledger" in proc.stderr
    run = write_ledger(tmp_path / "r", noticed_reclaim())
    prices = tmp_path / "p.yaml"
    prices.write_text("instance_types: {g5.xlarge: {spot: 1}}\n")
    proc = elastic("report", run, "--prices", str(prices))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "on-demand" in proc.stderr
