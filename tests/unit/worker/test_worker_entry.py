"""The one worker entry: a plain job and a sweep trial (through its WorkerSetup) take the same path; logging
is configured there, with Ray Train's per-report lines off unless ELASTIC_LOG_LEVEL=DEBUG."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from elastic.errors import PlacementEnded
from elastic.worker import entrypoint


@pytest.fixture
def fake_worker(monkeypatch):
    """worker_main with the session and the job's function replaced: records what runs, in order."""
    calls = []

    class FakeSession:
        def __init__(self, spec, run_name, placement=None):
            calls.append(("session", run_name))

        def attempt_ended(self, step, reason):
            calls.append(("ended", step, reason))

        def drain_reports(self):
            calls.append(("drained",))

        def close(self):
            calls.append(("closed",))

    def job(session):
        calls.append(("job",))

    monkeypatch.setattr(entrypoint, "Session", FakeSession)
    monkeypatch.setattr(entrypoint, "resolve_entrypoint", lambda target: job)
    monkeypatch.setattr(
        entrypoint.JobSpec,
        "model_validate",
        staticmethod(lambda data: SimpleNamespace(entrypoint="job.py:train", api="session")),
    )
    return calls


def test_plain_job_and_setup_share_one_entry(fake_worker):
    entrypoint.worker_main({"spec": {}, "run_name": "plain"})
    # A function that returns: every report queued by then is made before the worker leaves.
    assert fake_worker == [("session", "plain"), ("job",), ("drained",), ("closed",)]

    class Setup:
        def before_session(self, spec):
            fake_worker.append(("before",))

        def run(self, session, train):
            fake_worker.append(("setup",))
            train(session)
            raise PlacementEnded(5)  # ends like the job's own placement end: returns normally

    fake_worker.clear()
    entrypoint.worker_main({"spec": {}, "run_name": "trial"}, Setup())
    assert fake_worker == [
        ("before",),
        ("session", "trial"),
        ("setup",),
        ("job",),
        ("ended", 5, "placement ended"),
        ("closed",),
    ]


@pytest.fixture
def elastic_logger():
    """The `elastic` logger as it was before the test configured it (other tests read plain stdout)."""
    logger = logging.getLogger("elastic")
    saved = logger.level, logger.propagate, list(logger.handlers)
    yield logger
    logger.level, logger.propagate, logger.handlers[:] = saved[0], saved[1], saved[2]


def test_ray_train_report_lines_are_off_unless_debug(monkeypatch, capsys, elastic_logger):
    from ray.train.v2._internal.execution import context

    ray_logger = logging.getLogger(context.__file__)
    monkeypatch.setattr(ray_logger, "level", logging.NOTSET)
    monkeypatch.delenv("ELASTIC_LOG_LEVEL", raising=False)
    entrypoint._configure_logging()
    assert ray_logger.level == logging.WARNING
    logging.getLogger("elastic.worker.session").info("resumed from checkpoint at step 3")
    assert "[elastic] resumed from checkpoint at step 3" in capsys.readouterr().out

    ray_logger.setLevel(logging.NOTSET)
    monkeypatch.setenv("ELASTIC_LOG_LEVEL", "DEBUG")
    entrypoint._configure_logging()
    assert ray_logger.level == logging.NOTSET
