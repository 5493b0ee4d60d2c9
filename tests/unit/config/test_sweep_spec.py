"""Unit tests for elastic/config/sweep_spec.py: the example sweep, defaults, trial jobs, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elastic.config.sweep_spec import load_sweep_spec, parse_sweep_spec, sweep_schema, trial_job
from elastic.errors import SpecError

REPO = Path(__file__).resolve().parents[3]

# Line numbers matter for the error tests: 1 name / 2 job / 3 space: / 4 lr / 5 metric / 6 mode
MINIMAL = """\
name: s
job: jobs/digits_ddp.yaml
space:
  lr: {loguniform: [0.001, 0.1]}
metric: loss
mode: min
"""


def parse(extra: str = "", base: str = MINIMAL, overrides=()):
    return parse_sweep_spec(base + textwrap.dedent(extra), source="s.yaml", overrides=overrides)


def error(extra: str = "", base: str = MINIMAL, overrides=()) -> str:
    with pytest.raises(SpecError) as info:
        parse(extra, base, overrides)
    return str(info.value)


def test_example_sweep_loads_with_its_job():
    sweep, job = load_sweep_spec(REPO / "jobs" / "digits_sweep.yaml")
    assert sweep.num_samples == 16 and sweep.auto and sweep.scheduler.type == "asha"
    assert job.name == "digits-ddp" and job.workers.min == 1 and job.workers.max_workers == 1
    assert job.workers.cpus == 0.25 and job.config["epochs"] == 2


def test_defaults():
    sweep = parse()
    assert sweep.gpu_share == "auto" and sweep.scheduler.type == "fifo" and sweep.num_samples == 1
    assert sweep.max_concurrent is None and sweep.driver_cpus == 0.05 and sweep.packing.max_oom_retries == 2


def test_numeric_share_and_overrides():
    sweep = parse(overrides=["gpu_share=0.25", "scheduler.type=asha", "num_samples=4"])
    assert sweep.gpu_share == 0.25 and sweep.scheduler.type == "asha" and sweep.num_samples == 4


def test_trial_job_sets_config_and_dotted_fields():
    sweep, job = load_sweep_spec(REPO / "jobs" / "digits_sweep.yaml")
    trial = trial_job(job, {"lr": 0.01, "train.precision": "bf16", "workers.cpus": 0.5})
    assert trial.config["lr"] == 0.01 and trial.train.precision == "bf16" and trial.workers.cpus == 0.5
    assert job.config["lr"] == 0.05  # the sweep's job is unchanged


@pytest.mark.parametrize(
    "extra, expected",
    [
        ("scheduler: {type: hyperband}\n", "s.yaml:7: scheduler.type: Input should be 'fifo', 'asha' or 'pbt'"),
        ("gpu_share: 1.5\n", "s.yaml:7: gpu_share: use a number in (0, 1] (e.g. 0.25) or auto"),
        ("gpu_share: half\n", "s.yaml:7: gpu_share: use a number in (0, 1]"),
        ("max_concurent: 4\n", "s.yaml:7: max_concurent: unknown field; did you mean 'max_concurrent'?"),
        ("packing: {gpu_memory_gbs: 2}\n", "packing.gpu_memory_gbs: unknown field; did you mean 'gpu_memory_gb'?"),
        ("scheduler: {type: asha, max_t: 2, grace_period: 5}\n", "grace_period (5) exceeds max_t (2)"),
    ],
)
def test_errors_name_field_line_and_fix(extra, expected):
    assert expected in error(extra)


def test_space_errors():
    bad = MINIMAL.replace("{loguniform: [0.001, 0.1]}", "{uniform: [1, 0.5]}")
    assert "s.yaml:4: space.lr: uniform: low (1.0) must be below high (0.5)" in error(base=bad)
    bad = MINIMAL.replace("{loguniform: [0.001, 0.1]}", "{loguniform: [0, 0.1]}")
    assert "loguniform: low (0.0) must be > 0" in error(base=bad)
    bad = MINIMAL.replace("{loguniform: [0.001, 0.1]}", "{choice: [1], grid: [2]}")
    assert "give exactly one of choice, uniform, loguniform, grid (got choice, grid)" in error(base=bad)
    bad = MINIMAL.replace("{loguniform: [0.001, 0.1]}", "{chioce: [1]}")
    assert "space.lr.chioce: unknown field; did you mean 'choice'?" in error(base=bad)


def test_missing_fields_and_mode():
    assert "mode: required field is missing" in error(base=MINIMAL.replace("mode: min\n", ""))
    assert "s.yaml:6: mode: Input should be 'min' or 'max'" in error(base=MINIMAL.replace("mode: min", "mode: up"))


def test_pbt_needs_something_to_perturb_and_known_keys():
    bad = MINIMAL.replace("{loguniform: [0.001, 0.1]}", "{grid: [0.1, 0.01]}") + "scheduler: {type: pbt}\n"
    assert "pbt needs a non-grid space key" in error(base=bad)
    assert "scheduler.mutate: 'momentum' is not a key of space" in error("scheduler: {type: pbt, mutate: [momentum]}\n")


def test_space_key_must_be_a_job_field(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(MINIMAL.replace("lr:", "workers.mn:").replace("job: jobs/", f"job: {REPO}/jobs/"))
    with pytest.raises(
        SpecError, match=r"workers.mn: unknown field; did you mean 'min'\?.*a space key must be a job field"
    ):
        load_sweep_spec(path)


def test_missing_job_and_bad_override(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(MINIMAL.replace("jobs/digits_ddp.yaml", "jobs/nope.yaml"))
    with pytest.raises(SpecError, match="job: jobs/nope.yaml not found"):
        load_sweep_spec(path)
    path.write_text(MINIMAL.replace("job: jobs/", f"job: {REPO}/jobs/") + "overrides: {workers: {mn: 1}}\n")
    with pytest.raises(SpecError, match="workers.mn: unknown field"):
        load_sweep_spec(path)


def test_schema_names_the_fields():
    props = sweep_schema()["properties"]
    assert {"space", "gpu_share", "scheduler", "packing", "num_samples", "max_concurrent"} <= set(props)


def test_cli_exits_2_with_one_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(MINIMAL + "gpu_share: 2\n")
    env = {**os.environ, "ELASTIC_HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "elastic", "sweep", str(path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {path}:7: gpu_share: use a number in (0, 1] (e.g. 0.25) or auto (got 2)"
    ]


def test_shipped_schema_is_current():
    import json

    assert json.loads((REPO / "docs" / "sweep.schema.json").read_text()) == sweep_schema()
