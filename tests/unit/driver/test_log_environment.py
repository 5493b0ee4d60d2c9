"""Every rank's `[elastic]` lines reach the job's log: Ray's driver folds lines that differ only in tokens with
digits into one "[repeated Nx across cluster]", and a job's environment tells it not to fold ours."""

from __future__ import annotations

import re

from ray._private.ray_logging import LogDeduplicator

from elastic.driver.submit import NEVER_FOLDED, log_environment
from elastic.logs import LEVEL_VARIABLE

RANK_LINES = [
    "[elastic] worker rank 0/2 on node 5d877b5b737fabac market=spot device=cpu",
    "[elastic] worker rank 1/2 on node 3f7e9475b78dde6d market=spot device=cpu",
]


def _printed(allow_re: str | None) -> list[str]:
    fold = LogDeduplicator(agg_window_s=5, allow_re=allow_re, skip_re=None, _timesource=lambda: 100.0)
    printed = []
    for pid, line in enumerate(RANK_LINES):
        batch = {"ip": "127.0.0.1", "pid": pid, "job": "01", "is_err": False, "lines": [line]}
        printed += [each for out in fold.deduplicate(batch) for each in out["lines"]]
    return printed


def test_ray_folds_two_ranks_placement_lines_into_one_without_the_allow_regex():
    assert _printed(None) == RANK_LINES[:1]


def test_with_the_jobs_log_environment_every_rank_line_is_printed():
    allow = log_environment()["RAY_DEDUP_LOGS_ALLOW_REGEX"]
    assert _printed(allow) == RANK_LINES
    assert re.search(allow, "Epoch 3: loss 0.12") is None  # other lines are folded as Ray does


def test_the_log_level_travels_with_it(monkeypatch):
    monkeypatch.setenv(LEVEL_VARIABLE, "DEBUG")
    assert log_environment() == {**NEVER_FOLDED, LEVEL_VARIABLE: "DEBUG"}
    monkeypatch.delenv(LEVEL_VARIABLE)
    assert log_environment() == NEVER_FOLDED
