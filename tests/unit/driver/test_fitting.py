"""The driver's view of one placement's fit(): its end is seen at the sessions' acknowledgement, before fit()
returns, and a fit that fails hands its error to the driver loop."""

from __future__ import annotations

import threading
import time

import pytest

from elastic import logs
from elastic.driver.placements import _Fitting


@pytest.fixture(autouse=True)
def elastic_logs():
    logs.configure("INFO")  # as a job's driver: the executor's log lines reach stdout


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


def _controller_died_in_constructor(message: str):
    from ray.exceptions import ActorDiedError, RayTaskError

    return ActorDiedError(RayTaskError("TrainController.__init__", f"Traceback ...\n{message}", RuntimeError(message)))


def test_a_controller_that_tore_its_read_of_rays_run_snapshot_is_started_again():
    """Seen on the local stack: a placement started ahead read Ray Train's run snapshot while the ending
    placement's controller rewrote it, and its controller died in its constructor."""
    from ray.train import ControllerError

    from elastic.driver.placements import controller_failed

    torn = _controller_died_in_constructor(
        "ray.train.v2._internal.exceptions.CheckpointManagerInitializationError: "
        "Unterminated string starting at: line 1 column 769 (char 768)"
    )
    assert controller_failed(torn)
    assert controller_failed(ControllerError(RuntimeError("worker group failed to start")))
    # The user's own errors, and other constructor failures, are not retried as controller errors
    # (the retry budget itself is elastic.placement.loop's: tests/unit/test_placement_loop.py).
    assert not controller_failed(ValueError("bad config"))
    assert not controller_failed(_controller_died_in_constructor("ValueError: storage_path is not writable"))
