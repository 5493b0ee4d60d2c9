"""ASHA's rungs survive a sweep restore (elastic.sweep.SchedulerState): Tune restores the scheduler from
tuner.pkl as it was before any trial ran, so without this a resumed sweep stops no trial that reaches a rung first."""

from __future__ import annotations

from types import SimpleNamespace

import ray.cloudpickle as cloudpickle
from ray.tune.schedulers import TrialScheduler

from elastic.config.sweep_spec import parse_sweep_spec
from elastic.sweep.progress import SchedulerState
from elastic.sweep.runner import scheduler

SWEEP = """\
name: s
job: jobs/digits_ddp.yaml
space:
  lr: {grid: [0.1, 0.00001]}
metric: mean_loss
mode: min
scheduler: {type: asha, max_t: 20, grace_period: 2, reduction_factor: 2}
"""


def tuner_pickle(sweep_text: str = SWEEP) -> bytes:
    """What Tune writes to tuner.pkl before the first trial: scheduler and callbacks in one pickle."""
    sweep = parse_sweep_spec(sweep_text, source="s.yaml")
    trial_scheduler = scheduler(sweep)
    trial_scheduler.set_search_properties("mean_loss", "min")
    return cloudpickle.dumps({"scheduler": trial_scheduler, "callbacks": [SchedulerState(trial_scheduler)]})


def result(iteration: int, loss: float) -> dict:
    return {"training_iteration": iteration, "mean_loss": loss}


def test_a_restored_sweep_still_stops_a_trial_below_the_rung_cutoff():
    saved = tuner_pickle()
    first = cloudpickle.loads(saved)
    good, bad = SimpleNamespace(trial_id="good"), SimpleNamespace(trial_id="bad")
    for trial in (good, bad):
        first["scheduler"].on_trial_add(None, trial)
    assert first["scheduler"].on_trial_result(None, good, result(2, 0.5)) == TrialScheduler.CONTINUE
    state = cloudpickle.loads(cloudpickle.dumps(first["callbacks"][0].get_state()))  # Tune's experiment checkpoint

    # The driver dies; Tuner.restore unpickles tuner.pkl (no rungs) and hands the callback its saved state.
    restored = cloudpickle.loads(saved)
    assert restored["callbacks"][0].scheduler is restored["scheduler"]
    restored["callbacks"][0].set_state(state)
    restored["scheduler"].on_trial_add(None, bad)  # requeued
    assert restored["scheduler"].on_trial_result(None, bad, result(2, 2.3)) == TrialScheduler.STOP

    # Without the saved state the restored scheduler lets the bad trial through: what this guards against.
    forgetful = cloudpickle.loads(saved)["scheduler"]
    forgetful.on_trial_add(None, bad)
    assert forgetful.on_trial_result(None, bad, result(2, 2.3)) == TrialScheduler.CONTINUE


def test_the_state_is_a_snapshot_and_fifo_saves_none():
    first = cloudpickle.loads(tuner_pickle())
    good = SimpleNamespace(trial_id="good")
    first["scheduler"].on_trial_add(None, good)
    state = first["callbacks"][0].get_state()
    first["scheduler"].on_trial_result(None, good, result(2, 0.5))  # after the checkpoint: not in it
    restored = cloudpickle.loads(tuner_pickle())
    restored["callbacks"][0].set_state(state)
    assert all(not recorded for _, recorded in restored["scheduler"]._brackets[0]._rungs)

    fifo = cloudpickle.loads(
        tuner_pickle(SWEEP.replace("type: asha, max_t: 20, grace_period: 2, reduction_factor: 2", "type: fifo"))
    )
    assert fifo["callbacks"][0].get_state() is None
