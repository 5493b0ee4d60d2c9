"""Verbs run through a cluster's job API (--address): the command line the job runs, the result line it prints
and reads back, and what the client shows. The job API is replaced by fakes: nothing leaves this process."""

from __future__ import annotations

import importlib
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from elastic.cli import remote as cli_remote
from elastic.driver import remote
from elastic.driver.submit import Target

cli_main = importlib.import_module("elastic.cli.main")  # elastic.cli re-exports main(), the function
REPO = Path(__file__).resolve().parents[3]
RESULT = {"trials": [], "best_config": {"lr": 0.1}, "errors": 0, "metric": "mean_loss", "mode": "min"}


class FakeJobs:
    """What remote.start and remote.follow use of Ray's JobSubmissionClient."""

    def __init__(self, chunks: list[str], running: list | None = None):
        self.chunks, self.running, self.submitted = chunks, running or [], []

    def list_jobs(self):
        return self.running

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)

    async def tail_job_logs(self, job_id):
        for chunk in self.chunks:
            yield chunk

    def get_job_status(self, job_id):
        return type("Status", (), {"value": "SUCCEEDED"})()


@pytest.fixture
def jobs(monkeypatch):
    fake = FakeJobs(["[sweep] trial 1 started\n[sweep] tri", "al 2 started\n" + remote.result_line(RESULT) + "\n"])
    monkeypatch.setattr(remote, "client", lambda target: fake)
    monkeypatch.setattr(remote, "driver_placement", lambda target: None)
    monkeypatch.setattr(cli_remote, "resolve_target", lambda address: Target(address, None))
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv(remote.RESULT_VARIABLE, raising=False)
    return fake


def run(*args: str):
    return CliRunner().invoke(cli_main.cli, list(args), catch_exceptions=False)


def test_a_sweep_with_address_runs_its_own_command_line_as_a_job_and_prints_the_result_json(jobs):
    out = run("sweep", "jobs/digits_sweep.yaml", "--set", "num_samples=2", "--json", "--address", "http://h:8265")
    assert out.exit_code == 0, out.output
    [job] = jobs.submitted
    assert shlex.split(job["entrypoint"]) == [
        "python",
        "-m",
        "elastic",
        "sweep",
        "jobs/digits_sweep.yaml",
        "--set",
        "num_samples=2",
        "--json",
    ]
    assert job["runtime_env"]["working_dir"] == str(REPO)
    assert job["runtime_env"]["env_vars"][remote.RESULT_VARIABLE] == "1"
    assert job["runtime_env"]["env_vars"]["RAY_API_SERVER_ADDRESS"] == "http://h:8265"
    assert job["metadata"]["elastic_run"] == "sweep digits-sweep" and job["submission_id"].startswith("sweep-digits")
    # The progress lines came through whole (a line split across two chunks too); the result line did not.
    assert "[sweep] trial 1 started\n[sweep] trial 2 started\n" in out.stderr
    assert json.loads(out.stdout) == RESULT


def test_a_pack_with_address_passes_every_job_file_and_override(jobs):
    jobs.chunks = [remote.result_line({"pack": "p", "jobs": [], "peak_concurrent": 0, "errors": 0}) + "\n"]
    out = run(
        "pack", "jobs/digits_ddp.yaml", "jobs/charlm.yaml", "--gpu-share", "0.25", "--set", "charlm:config.epochs=1",
        "--json", "--address", "http://h:8265",
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    [job] = jobs.submitted
    assert shlex.split(job["entrypoint"])[3:] == [
        "pack", "jobs/digits_ddp.yaml", "jobs/charlm.yaml", "--gpu-share", "0.25", "--set", "charlm:config.epochs=1",
        "--json",
    ]  # fmt: skip
    assert job["metadata"]["elastic_run"].startswith("pack pack-")
    assert json.loads(out.stdout)["pack"] == "p"


def test_running_the_same_sweep_again_follows_the_running_job_instead_of_a_second_driver(jobs):
    status = type("Status", (), {"value": "RUNNING"})()
    jobs.running = [type("Job", (), {"metadata": {"elastic_run": "sweep digits-sweep"}, "status": status,
                                     "submission_id": "sweep-digits-sweep-1"})()]  # fmt: skip
    out = run("sweep", "jobs/digits_sweep.yaml", "--resume", "--json", "--address", "http://h:8265")
    assert out.exit_code == 0 and jobs.submitted == []
    assert "following the running Ray job sweep-digits-sweep-1" in out.stderr


def test_detach_returns_at_once_and_says_how_to_follow_and_stop(jobs):
    out = run("bench", "checkpoint", "--size-mb", "8", "--address", "http://h:8265", "--detach")
    assert out.exit_code == 0
    argv = shlex.split(jobs.submitted[0]["entrypoint"])[3:]
    assert argv[:2] == ["bench", "checkpoint"] and "--size-mb" in argv and "--detach" not in argv
    assert "--address" not in argv
    assert "elastic logs bench-checkpoint-" in out.stderr and "elastic stop" in out.stderr


def test_an_http_ray_address_means_the_job_api_and_a_gcs_address_means_here(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert remote.remote_address(None) == "http://head:8265"
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert remote.remote_address(None) is None
    assert remote.remote_address("http://x:8265") == "http://x:8265"


def test_inside_the_job_the_verb_prints_one_result_line(monkeypatch, capsys):
    monkeypatch.setenv(remote.RESULT_VARIABLE, "1")
    cli_remote.finish(RESULT, as_json=False, show=lambda r: pytest.fail("no table inside the job"))
    line = capsys.readouterr().out.strip()
    assert line.startswith(remote.RESULT_PREFIX) and json.loads(line[len(remote.RESULT_PREFIX) :]) == RESULT


def test_a_file_outside_the_working_directory_is_one_line_and_exit_2(jobs, tmp_path, cli_entry):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text((REPO / "jobs" / "digits_sweep.yaml").read_text().replace("jobs/", f"{REPO}/jobs/"))
    proc = cli_entry("sweep", str(sweep), "--address", "http://127.0.0.1:9")
    assert proc.returncode == 2 and "must be inside the current directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and jobs.submitted == []


def test_a_job_that_printed_no_result_fails_with_its_status(jobs):
    jobs.chunks = ["Traceback: something broke\n"]
    proc = CliRunner().invoke(cli_main.cli, ["bench", "overhead", "--address", "http://h:8265"])
    assert proc.exit_code != 0 and "printed no result" in str(proc.exception)
