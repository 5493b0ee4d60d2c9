"""Tune callbacks of sweeps and packs: live progress lines, a pack's live table, and ASHA's rungs carried across a
restore."""

from __future__ import annotations

import logging
import pickle
import sys
import time

from ray.tune import Callback

log = logging.getLogger(__name__)


class Progress(Callback):
    """Live progress: one line per trial event on stderr (Tune's own table is turned off). A pack (label "pack")
    names each trial by its job."""

    def __init__(self, label: str = "sweep"):
        self.label = label

    def _name(self, trial) -> str:
        return trial.config.get("job", trial.trial_id) if self.label == "pack" else f"trial {trial.trial_id}"

    def on_trial_start(self, iteration, trials, trial, **info):
        what = "" if self.label == "pack" else f" {_short(trial.config)}"
        self._line(f"{self._name(trial)} started{what} ({_count(trials, 'RUNNING')} running)")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        shown = {k: result[k] for k in ("training_iteration", "step", "loss", "accuracy") if k in result}
        self._line(f"{self._name(trial)} {_short(shown)}")

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._line(
            f"{self._name(trial)} finished ({_count(trials, 'TERMINATED')} done, {_count(trials, 'RUNNING')} running)"
        )

    def on_trial_error(self, iteration, trials, trial, **info):
        self._line(f"{self._name(trial)} FAILED: {str(getattr(trial, 'error_msg', '') or '')[:160]}")

    def _line(self, text: str) -> None:
        sys.stderr.write(f"[{self.label} {time.strftime('%H:%M:%S')}] {text}\n")
        sys.stderr.flush()


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


def _short(values: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def _count(trials, status: str) -> int:
    return sum(t.status == status for t in trials)


class LiveTable(Callback):
    """A live table of a pack's jobs (job, state, iterations, step, loss) on stderr, redrawn as results arrive,
    when stderr is a terminal; elsewhere (a pipe, a remote job's log) the Progress lines say the same."""

    def __init__(self, jobs: list[str]):
        self.rows = {job: {"state": "PENDING", "iterations": 0, "step": None, "loss": None} for job in jobs}
        self._live = None

    def setup(self, **info):
        from rich.console import Console
        from rich.live import Live

        console = Console(stderr=True)
        if console.is_terminal:
            self._live = Live(self._table(), console=console, refresh_per_second=2, transient=True)
            self._live.start()

    def on_trial_start(self, iteration, trials, trial, **info):
        self._update(trial, state="RUNNING")

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self._update(
            trial,
            state="RUNNING",
            iterations=result.get("training_iteration"),
            step=result.get("step"),
            loss=result.get("loss"),
        )

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._update(trial, state="TERMINATED")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._update(trial, state="ERROR")

    def on_experiment_end(self, trials, **info):
        if self._live is not None:
            self._live.stop()

    def _update(self, trial, **values) -> None:
        row = self.rows.setdefault(trial.config.get("job", trial.trial_id), {})
        row.update({k: v for k, v in values.items() if v is not None})
        if self._live is not None:
            self._live.update(self._table())

    def _table(self):
        from rich.table import Table

        table = Table("job", "state", "iterations", "step", "loss", title="pack")
        for job, row in self.rows.items():
            loss = row.get("loss")
            table.add_row(
                job,
                row.get("state", ""),
                str(row.get("iterations") or 0),
                str(row.get("step") if row.get("step") is not None else "-"),
                f"{loss:.4g}" if isinstance(loss, float) else "-",
            )
        return table

    def __getstate__(self):  # saved with the experiment: the live display is this process's alone
        return {**self.__dict__, "_live": None}
