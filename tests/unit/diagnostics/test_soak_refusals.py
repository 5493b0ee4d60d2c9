"""The soak refuses, in one line with the fix, what it cannot run: no local stack, or one without its S3 proxy."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic.config.spec import load_job_spec
from elastic.diagnostics.soak import PROXY_MISSING, Soak
from elastic.driver.submit import Target
from elastic.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
SPEC = load_job_spec(ROOT / "jobs" / "digits_ddp.yaml", ())


def test_a_remote_cluster_is_refused_with_the_fix():
    with pytest.raises(UserError, match="local stack only; drop --address"):
        Soak(SPEC, Target("http://10.0.0.1:8265", None), None, io.StringIO(), print)


def test_a_stack_without_the_fault_proxy_is_refused_with_how_to_start_one():
    stack = SimpleNamespace(s3_upstream="", s3_endpoint="http://127.0.0.1:9000")
    with pytest.raises(UserError) as err:
        Soak(SPEC, Target("http://127.0.0.1:8265", stack), None, io.StringIO(), print)
    assert str(err.value) == PROXY_MISSING and "elastic local up --s3-faults" in PROXY_MISSING
    assert "\n" not in PROXY_MISSING
