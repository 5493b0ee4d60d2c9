"""The driver's view of one placement's fit(): its end is seen at the sessions' acknowledgement, before fit()
returns, and a fit that fails hands its error to the driver loop."""

from __future__ import annotations

import threading
import time

from elastic.trainer import _Fitting


class FakeTrainer:
    def __init__(self, release: threading.Event, error: Exception | None = None):
        self.release, self.error = release, error

    def fit(self):
        self.release.wait(10)
        if self.error:
            raise self.error
        return "result"


def test_the_end_is_seen_at_the_acknowledgement_while_fit_still_runs():
    release = threading.Event()
    fitting = _Fitting(FakeTrainer(release))
    polls = []

    def acknowledged():
        polls.append(time.monotonic())
        return {"step": 7, "kind": "preemption"} if len(polls) >= 3 else None

    assert fitting.wait_for_end(acknowledged) == {"step": 7, "kind": "preemption"}
    assert fitting._thread.is_alive()  # Ray's controller is still shutting the ended placement down
    release.set()
    fitting.finish_quietly()
    assert fitting.result == "result"


def test_a_fit_that_returns_without_acknowledgement_ends_the_wait():
    release = threading.Event()
    release.set()
    fitting = _Fitting(FakeTrainer(release))
    assert fitting.wait_for_end(lambda: None) is None
    assert fitting.result == "result" and fitting.error is None


def test_a_failed_fit_hands_its_error_over(capsys):
    release = threading.Event()
    release.set()
    fitting = _Fitting(FakeTrainer(release, RuntimeError("controller died")))
    assert fitting.wait_for_end(lambda: None) is None
    assert isinstance(fitting.error, RuntimeError)
    fitting.finish_quietly()  # after an acknowledged end a failed shutdown is only logged
    assert "shutdown failed (RuntimeError: controller died)" in capsys.readouterr().out
