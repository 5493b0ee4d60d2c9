"""The job driver connects with its tasks and actors at Ray's default worker niceness: a job submitted with a
label selector (as ours are) would otherwise keep its supervisor's niceness 0 for all of them."""

from __future__ import annotations

import os

from elastic.driver import job


def test_the_driver_asks_for_rays_worker_niceness_and_restores_the_override_switch(monkeypatch):
    calls = []

    def init(**kwargs):
        calls.append((kwargs, os.environ.get("RAY_OVERRIDE_JOB_RUNTIME_ENV")))

    monkeypatch.setattr(job.ray, "init", init)
    monkeypatch.delenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", raising=False)
    job._connect()
    [(kwargs, override)] = calls
    assert kwargs["runtime_env"] == {"env_vars": {"RAY_worker_niceness": "15"}}
    assert override == "1"  # the job's runtime env names the variable too (0): the driver's value wins
    assert "RAY_OVERRIDE_JOB_RUNTIME_ENV" not in os.environ

    monkeypatch.setenv("RAY_OVERRIDE_JOB_RUNTIME_ENV", "0")
    job._connect()
    assert os.environ["RAY_OVERRIDE_JOB_RUNTIME_ENV"] == "0"  # a user's own setting is put back
