"""Unit tests for elastic/sweep/pack.py without Ray: reading the jobs and their overrides, names, and what the
report computes (jobs training at once, each rank's GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.errors import SpecError, UserError
from elastic.placement.packing import merged
from elastic.sweep import pack

ROOT = Path(__file__).resolve().parents[3]
DIGITS, CHARLM = ROOT / "jobs" / "digits_ddp.yaml", ROOT / "jobs" / "charlm.yaml"


def test_overrides_go_to_every_job_or_to_the_job_they_name():
    jobs = pack.load_packed_jobs(
        [DIGITS, CHARLM],
        ("config.seed=7", "charlm:config.epochs=1", "charlm:runtime_env.env_vars.ELASTIC_INJECT_OOM=12:0.5"),
    )
    digits, charlm = jobs
    assert [j.name for j in jobs] == ["digits-ddp", "charlm"] and digits.source == str(DIGITS)
    assert digits.job.config["seed"] == 7 and charlm.job.config["seed"] == 7
    assert charlm.job.config["epochs"] == 1 and digits.job.config["epochs"] == 12
    assert charlm.job.runtime_env.env_vars == {"ELASTIC_INJECT_OOM": "12:0.5"}  # a ':' in the value stays
    assert digits.job.runtime_env.env_vars == {}


def test_bad_packs_are_one_line_each():
    with pytest.raises(SpecError, match="already packed"):
        pack.load_packed_jobs([DIGITS, DIGITS], ())
    with pytest.raises(SpecError, match=r"no packed job is named gpt \(packed: digits-ddp, charlm\)"):
        pack.load_packed_jobs([DIGITS, CHARLM], ("gpt:config.epochs=1",))
    with pytest.raises(SpecError, match="workers.min"):
        pack.load_packed_jobs([DIGITS], ("digits-ddp:workers.min=0",))
    with pytest.raises(UserError, match="at least one job"):
        pack.load_packed_jobs([], ())


def test_the_same_jobs_and_settings_pack_under_the_same_name_in_any_order():
    a = pack.load_packed_jobs([DIGITS, CHARLM], ())
    b = pack.load_packed_jobs([CHARLM, DIGITS], ())
    c = pack.load_packed_jobs([CHARLM, DIGITS], ("charlm:config.epochs=1",))
    assert pack.default_name(a) == pack.default_name(b) != pack.default_name(a[:1])
    assert pack.default_name(c) != pack.default_name(a)  # another setting: another pack
    assert pack.run_name("pack-1", a[1]) == "pack-1-charlm"
    assert pack.experiment_uri("pack-1", a) == "s3://elastic/runs/pack-1"


def test_peak_concurrent_counts_jobs_not_windows():
    windows = {
        "a": [(0, 10), (10, 20), (5, 12)],  # contiguous windows and two attempts overlapping: one job
        "b": [(15, 30)],
        "c": [(25, 40)],
    }
    assert pack.peak_concurrent(windows) == 2  # a+b at 15-20, b+c at 25-30, never all three
    windows["c"].append((18, 19))
    assert pack.peak_concurrent(windows) == 3
    assert pack.peak_concurrent({"a": [(0, 1)], "b": [(1, 2)]}) == 1  # touching is not overlapping
    assert pack.peak_concurrent({}) == 0


def test_merged_intervals():
    assert merged([(5, 6), (0, 2), (1, 3), (3, 4), (7, 7)]) == [(0, 4), (5, 6)]


def test_gpu_names_per_rank():
    ranks = [{"rank": 0, "node": "abcdef0123456789", "gpus": ["0"]}, {"rank": 1, "node": "fedcba98", "gpus": []}]
    assert pack.gpu_names(ranks) == ["abcdef01:0", "fedcba98:-"]
    assert pack.gpu_names(None) == []


def test_the_live_table_follows_each_job():
    from types import SimpleNamespace

    from elastic.sweep.progress import LiveTable

    table = LiveTable(["charlm", "digits-ddp"])
    table.setup()  # not a terminal here: no live display, the rows still follow
    trial = SimpleNamespace(config={"job": "charlm"}, trial_id="t1")
    table.on_trial_start(0, [], trial)
    table.on_trial_result(0, [], trial, {"training_iteration": 3, "step": 60, "loss": 2.5})
    assert table.rows["charlm"] == {"state": "RUNNING", "iterations": 3, "step": 60, "loss": 2.5}
    table.on_trial_complete(0, [], trial)
    assert table.rows["charlm"]["state"] == "TERMINATED" and table.rows["digits-ddp"]["state"] == "PENDING"
    assert table._table().row_count == 2
