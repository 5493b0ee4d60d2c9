"""Memory planning: what a rank holds of the training state under ddp and fsdp, and `submit` refusing, before
anything starts, a job whose state cannot fit the GPUs it asks for."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.parallel.memory import estimate
from elastic.parallel.planning import ModelPlan, refusal, smallest_gpu_memory, workers_needed

ROOT = Path(__file__).resolve().parents[3]
SEVEN_B = ModelPlan(parameters=7_000_000_000, optimizer="AdamW")


def test_ddp_holds_the_whole_state_and_fsdp_its_share():
    ddp, fsdp = estimate(1000, "ddp", 4), estimate(1000, "fsdp", 4)
    assert ddp.total == 1000 * 4 * (1 + 1 + 2)  # fp32 parameters, gradients, AdamW's two slots
    assert fsdp.total == ddp.total / 4
    assert estimate(1001, "fsdp", 2).parameters == 501 * 4  # a rank's shard is rounded up


def test_7b_with_adamw_under_ddp_is_refused_on_a_24_gb_gpu_naming_fsdp_and_the_workers_needed():
    line = refusal(SEVEN_B, "ddp", 1, 24, "the A10G GPU")
    assert line.startswith("7.0B parameters with AdamW under ddp need ~112 GB per GPU; the A10G GPU has 24 GB")
    assert "set train.parallelism: fsdp with >= 6 workers" in line
    assert workers_needed(SEVEN_B, 24) == 6  # 112 GB / (24 GB x 0.8 left for the state) = 5.8
    assert refusal(SEVEN_B, "fsdp", 6, 24, "the A10G GPU") is None


def test_fsdp_with_too_few_workers_asks_for_more_and_cpu_offload_is_never_refused():
    line = refusal(SEVEN_B, "fsdp", 2, 24, "the GPU")
    assert "under fsdp with 2 workers need ~56 GB" in line and "set workers.min >= 6" in line
    assert refusal(SEVEN_B, "fsdp", 1, 24, "the GPU", cpu_offload=True) is None
    assert refusal(ModelPlan(125_000_000), "ddp", 1, 24, "the GPU") is None  # 2 GB fits


def test_the_gpu_memory_is_the_smallest_known_type_the_cluster_reports():
    assert smallest_gpu_memory(["H100", "A10G", "TPU-V4"]) == ("A10G", 24)
    assert smallest_gpu_memory(["some-new-gpu"]) is None


@pytest.fixture
def no_cluster(tmp_path, monkeypatch):
    """No local stack and no address: any step that asks a cluster fails with its own line."""
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path / "home"))
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)


def test_submit_refuses_a_7b_ddp_run_on_24_gb_with_one_line_before_asking_any_cluster(
    cli_entry, monkeypatch, no_cluster
):
    monkeypatch.chdir(ROOT)
    done = cli_entry(
        "submit", "jobs/gpt.yaml", "--set", "config.size=7b", "--set", "train.parallelism=ddp",
        "--set", "workers.gpus=1", "--set", "workers.gpu_memory_gb=24",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "need ~107 GB per GPU" in lines[0] and "fsdp with >= 6 workers" in lines[0], lines


def test_a_run_that_fits_goes_on_to_the_cluster(cli_entry, monkeypatch, no_cluster):
    monkeypatch.chdir(ROOT)
    done = cli_entry(
        "submit", "jobs/gpt.yaml", "--set", "config.size=125m", "--set", "workers.gpus=1",
        "--set", "workers.gpu_memory_gb=24",
    )  # fmt: skip
    assert done.returncode == 2 and "no cluster to talk to" in done.stderr, done.stderr  # it got that far


def test_a_broken_plan_hook_is_one_line_naming_it(tmp_path, cli_entry, monkeypatch, no_cluster):
    (tmp_path / "job.py").write_text("def train(session):\n    pass\n\ndef planned_model(config):\n    return 'big'\n")
    (tmp_path / "job.yaml").write_text(
        "name: j\nentrypoint: job.py:train\nworkers: {min: 1, gpus: 1, gpu_memory_gb: 24}\n"
        "checkpoint: {uri: 's3://b/runs', every_steps: 10}\n"
    )
    monkeypatch.chdir(tmp_path)
    done = cli_entry("submit", "job.yaml")
    assert done.returncode == 2 and "planned_model(config) returned 'big'" in done.stderr, done.stderr


def test_cpu_offload_without_gpus_is_refused_with_one_line(cli_entry, monkeypatch):
    monkeypatch.chdir(ROOT)
    done = cli_entry("spec", "check", "jobs/gpt.yaml", "--set", "train.fsdp.cpu_offload=true")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "cpu_offload" in done.stderr and "workers.gpus" in done.stderr, done.stderr
    fine = cli_entry(
        "spec", "check", "jobs/gpt.yaml", "--set", "train.fsdp.cpu_offload=true", "--set", "workers.gpus=1"
    )
    assert fine.returncode == 0, fine.stderr
