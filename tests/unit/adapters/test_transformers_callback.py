"""The Trainer's callback: each optimizer step is a session step, and the logs the Trainer computes after
`on_step_end` reach the session at the step they belong to (tracking filters by that step)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from elastic.adapters.transformers import elastic_callback  # noqa: E402


class FakeSession:
    def __init__(self):
        self.step_count = 0
        self.checkpoint_requested = False
        self.logged: list[tuple[int, dict]] = []

    def step(self, metrics=None):
        assert metrics is None  # the Trainer's logs arrive after this call
        self.step_count += 1

    def log_metrics(self, metrics):
        self.logged.append((self.step_count, metrics))


def trainer_steps(callback, session, steps: int, logging_steps: int):
    """What Trainer._inner_training_loop does per optimizer step: on_step_end, then log every logging_steps."""
    control = SimpleNamespace(should_save=False)
    for global_step in range(1, steps + 1):
        state = SimpleNamespace(global_step=global_step)
        callback.on_step_end(None, state, control)
        if global_step % logging_steps == 0:
            callback.on_log(None, state, control, logs={"loss": 1.0 / global_step, "epoch": 0.1, "note": "x"})
    return control


def test_the_trainers_logs_reach_the_session_at_their_own_step():
    session = FakeSession()
    trainer_steps(elastic_callback()(session), session, steps=20, logging_steps=5)
    assert [step for step, _ in session.logged] == [5, 10, 15, 20]
    assert session.logged[1][1] == {"loss": 0.1, "epoch": 0.1}  # numbers only


def test_logs_of_another_step_are_kept_for_the_save_but_not_logged_as_this_steps():
    session = FakeSession()
    callback = elastic_callback()(session)
    trainer_steps(callback, session, steps=3, logging_steps=3)
    # The end of train() logs its summary at the last step again; a log for a step not yet counted is skipped.
    callback.on_log(None, SimpleNamespace(global_step=4), None, logs={"train_loss": 0.5})
    assert [step for step, _ in session.logged] == [3]
    assert callback.logs == {"train_loss": 0.5}


def test_a_requested_checkpoint_makes_the_trainer_save_at_this_step():
    session = FakeSession()
    callback = elastic_callback()(session)
    session.checkpoint_requested = True
    control = trainer_steps(callback, session, steps=1, logging_steps=10)
    assert control.should_save and session.step_count == 1
