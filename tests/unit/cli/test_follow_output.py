"""`submit --json --follow` ends with one JSON line carrying the job's final status; `logs --follow` streams
the newest job of a run and exits with its status. The cluster is replaced by fakes of driver.submit."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from elastic.cli.main import cli
from elastic.driver import submit

JOB = "jobs/digits_ddp.yaml"


@pytest.fixture
def cluster(monkeypatch):
    """A fake job API: the job ends with the status the test sets; follow() writes two log lines."""
    ended = SimpleNamespace(status="SUCCEEDED", followed=[])
    target = submit.Target("http://127.0.0.1:8265", None)
    monkeypatch.setattr(submit, "resolve_target", lambda address: target)
    monkeypatch.setattr(
        submit, "submit", lambda spec, target, **kw: submit.Submitted("digits-ddp-1", "digits-ddp", target.address)
    )
    monkeypatch.setattr(submit, "latest_job", lambda target, run: "digits-ddp-1")
    monkeypatch.setattr(submit, "job_message", lambda target, job_id: f"job {ended.status.lower()}")

    def follow(target, job_id, out=None):
        ended.followed.append(job_id)
        (out or sys.stdout).write("[elastic] step 1\n[elastic] the run finished\n")
        return ended.status

    monkeypatch.setattr(submit, "follow", follow)
    return ended


def test_submit_json_follow_ends_with_the_final_status_line(cluster):
    result = CliRunner().invoke(cli, ["submit", JOB, "--json", "--follow"])
    assert result.exit_code == 0, result.output
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == {
        "run_name": "digits-ddp",
        "job_id": "digits-ddp-1",
        "status": "SUCCEEDED",
        "message": "job succeeded",
    }
    assert "[elastic] step 1" not in result.stdout  # logs go to stderr with --json


def test_submit_json_follow_of_a_failed_job_still_ends_with_its_status(cluster):
    cluster.status = "FAILED"
    result = CliRunner().invoke(cli, ["submit", JOB, "--json", "--follow"])
    assert json.loads(result.stdout.strip().splitlines()[-1])["status"] == "FAILED"
    assert result.exit_code != 0


def test_logs_follow_streams_the_newest_job_until_it_ends(cluster):
    result = CliRunner().invoke(cli, ["logs", "digits-ddp", "--follow"])
    assert result.exit_code == 0, result.output
    assert cluster.followed == ["digits-ddp-1"]
    assert result.stdout.splitlines()[-2:] == ["[elastic] the run finished", "job digits-ddp-1 SUCCEEDED"]
