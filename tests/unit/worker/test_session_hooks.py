"""Session.add_step_hook (how sweeps plug in) and CommitReports' choice of which commits to report, without
Ray: a Session is assembled from its collaborators, the report to Ray is a fake."""

from __future__ import annotations

import threading

import pytest

from elastic.checkpoint.checkpointer import SaveResult
from elastic.config.spec import CheckpointSpec
from elastic.observability.metrics import NoMetrics
from elastic.worker.audit import NoLedger
from elastic.worker.chaos import Chaos
from elastic.worker.jit import NoJustInTime
from elastic.worker.reporting import CommitReports
from elastic.worker.run_ledger import NoAttemptLedger
from elastic.worker.save_requests import SaveRequests
from elastic.worker.session import Session
from elastic.worker.telemetry import Telemetry
from elastic.worker.training_state import TrainingState


class _NeverDue:
    def due_on_every_rank(self, step: int) -> bool:
        return False


class _NoEnding:
    jit = NoJustInTime()


def _bare_session() -> Session:
    """The parts of a Session that step() uses, with nothing due (no checkpoint, no placement end)."""
    session = object.__new__(Session)
    session._state = TrainingState(0, 1)
    session._step_hooks = []
    session._ledger = NoLedger()
    session._attempt = NoAttemptLedger()
    session._chaos = Chaos(store=None, rank=0, plan=[])
    session._ending = _NoEnding()
    session._cadence = _NeverDue()
    session._user_saves, session._save_requests = False, SaveRequests()
    session._telemetry = Telemetry(
        NoMetrics(), 0, CheckpointSpec(uri="/tmp/unused", every_steps=10), None, lambda: None
    )
    return session


def test_step_hooks_run_in_order_after_each_step():
    session = _bare_session()
    calls = []
    session.add_step_hook(lambda step, metrics: calls.append(("first", step, metrics)))
    session.add_step_hook(lambda step, metrics: calls.append(("second", step, session.step_count)))
    session.step({"loss": 1.0})
    session.step()
    assert calls == [("first", 1, {"loss": 1.0}), ("second", 1, 1), ("first", 2, None), ("second", 2, 2)]


def test_a_hook_error_leaves_the_step():
    session = _bare_session()

    def stop(step, metrics):
        if step == 2:
            raise KeyboardInterrupt("probe done")

    session.add_step_hook(stop)
    session.step()
    with pytest.raises(KeyboardInterrupt):
        session.step()
    assert session.step_count == 2  # the step itself was taken


class _DueAt:
    def __init__(self, *steps: int):
        self.steps = set(steps)

    def due(self, step: int) -> bool:
        return step in self.steps

    def due_on_every_rank(self, step: int) -> bool:
        return step in self.steps


class _Watch:
    can_end = True

    def __init__(self, at: int, session: Session):
        self.at, self.session = at, session

    def end_requested(self) -> bool:
        return self.session.step_count >= self.at


def test_a_ray_train_function_is_asked_for_a_checkpoint_by_a_notice_the_driver_or_the_cadence():
    """api ray-train: the session never saves on its own; each step (report) notes whether one is wanted."""
    session = _bare_session()
    session._user_saves = True
    session._ending = _NoEnding()
    session._ending.jit = _DueAt(6)
    session._ending.watch = _Watch(at=9, session=session)
    session._cadence = _DueAt(3)
    asked = []
    for _ in range(10):
        session.step()
        asked.append((session.step_count, session._save_requests.reason))
        if session.step_count in (4, 7):
            session._save_requests.take()  # the function reported a checkpoint (save_reported takes it)
    assert asked == [
        (1, None),
        (2, None),
        (3, "periodic"),
        (4, "periodic"),  # still wanted until the function reports one
        (5, None),
        (6, "just-in-time"),  # a reclaim notice: the next report with a checkpoint ends the placement
        (7, "just-in-time"),
        (8, None),
        (9, "placement ending"),
        (10, "placement ending"),
    ]
    assert session.checkpoint_requested


def _result(step: int) -> SaveResult:
    return SaveResult(step=step, committed=True, blocked_seconds=0.0, total_seconds=0.1, attempts=1)


class _FakeReports(CommitReports):
    """Reports are recorded instead of sent to Ray; `hold` keeps the reporter busy until set."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, dict]] = []
        self.hold = threading.Event()
        super().__init__(rank=0, group=None, storage=None)

    def _report(self, result: SaveResult) -> None:
        self.hold.wait(5)
        with self._lock:
            metrics = self._unreported.pop(result.step, None)
        if metrics is not None:
            self.sent.append((result.step, metrics))


def test_a_commit_while_the_reporter_is_busy_is_passed_over_but_an_ending_one_is_reported():
    reports = _FakeReports()
    reports.expect(10, {"loss": 1.0})
    reports.committed(_result(10))  # the reporter takes it and is held
    reports.expect(20, {"loss": 0.5})
    reports.committed(_result(20))  # busy: passed over
    assert reports.metrics(20) == {"step": 20}
    reports.hold.set()
    assert reports.report_ending(20, {"step": 20, "accuracy": 0.9})  # the end of the run: reported after all
    assert reports.sent == [(10, {"step": 10, "loss": 1.0}), (20, {"step": 20, "accuracy": 0.9})]


def test_report_every_commit_queues_each_one_and_carry_replaces_metrics():
    reports = _FakeReports()
    reports.report_every_commit = True
    for step in (1, 2, 3):
        reports.expect(step, {})
        reports.committed(_result(step))
    assert reports.carry(3, {"step": 3, "final": True})  # queued behind the held report of step 1
    reports.hold.set()
    assert not reports.report_ending(3, {"step": 3})  # nothing passed over
    assert [step for step, _ in reports.sent] == [1, 2, 3] and reports.sent[2][1] == {"step": 3, "final": True}
    reports.forget(4)  # unknown steps are fine
