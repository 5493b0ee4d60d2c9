"""Tune callbacks of a sweep: live progress lines, and ASHA's rungs carried across a restore."""

from __future__ import annotations

import logging
import pickle
import sys
import time

from ray.tune import Callback

log = logging.getLogger(__name__)


class Progress(Callback):
    """Live progress: one line per trial event on stderr (Tune's own table is turned off)."""

    def on_trial_start(self, iteration, trials, trial, **info):
        _line(f"trial {trial.trial_id} started {_short(trial.config)} ({_count(trials, 'RUNNING')} running)")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        shown = {k: result[k] for k in ("training_iteration", "step", "loss", "accuracy") if k in result}
        _line(f"trial {trial.trial_id} {_short(shown)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        _line(
            f"trial {trial.trial_id} finished ({_count(trials, 'TERMINATED')} done, "
            f"{_count(trials, 'RUNNING')} running)"
        )

    def on_trial_error(self, iteration, trials, trial, **info):
        _line(f"trial {trial.trial_id} FAILED: {str(getattr(trial, 'error_msg', '') or '')[:160]}")


class SchedulerState(Callback):
    """Carries ASHA's rungs across a restore. Tune checkpoints the searcher and callbacks with the experiment but
    not the scheduler: Tuner.restore unpickles it from tuner.pkl as it was before the first trial, so a resumed
    sweep would forget every rung result and let a bad trial that reaches a rung first run to the end. Riding
    along as a callback, the rungs are saved with each experiment checkpoint and put back on restore (the
    callback and the scheduler come out of the same tuner.pkl, so this still points at Tune's scheduler)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def get_state(self) -> dict | None:
        from ray.tune.schedulers import AsyncHyperBandScheduler

        # PBT keys its state by Trial objects, which a restore recreates; only ASHA's plain state carries over.
        if not isinstance(self.scheduler, AsyncHyperBandScheduler):
            return None
        return {"asha": pickle.dumps(self.scheduler.__dict__)}  # a snapshot: later results don't leak into it

    def set_state(self, state: dict) -> None:
        if state.get("asha") is not None:
            self.scheduler.__dict__.update(pickle.loads(state["asha"]))


def _line(text: str) -> None:
    sys.stderr.write(f"[sweep {time.strftime('%H:%M:%S')}] {text}\n")
    sys.stderr.flush()


def _short(values: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _count(trials, status: str) -> int:
    return sum(t.status == status for t in trials)
