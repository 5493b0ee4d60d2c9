"""The faulted run's loop without Ray: faults fired from outside fire in order, each once the run's committed
checkpoints reach its step and the run has recovered from the one before; one the run never reaches is reported
as not fired. The job API, the run folder and the S3 fault proxy are fakes that move the run on."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from elastic.checkpoint.store import MARKER
from elastic.config.spec import load_job_spec
from elastic.diagnostics import soak_faults
from elastic.diagnostics.soak_plan import S3_SAVE_ERRORS, SLOW_S3, Fault
from elastic.driver.submit import Submitted, Target

ROOT = Path(__file__).resolve().parents[3]


class FakeRun:
    """A run that commits a checkpoint 50 steps on each time its status is asked, and succeeds at step 400."""

    def __init__(self):
        self.step = 0
        self.events: list[str] = []

    # the job API
    def get_job_status(self, job_id):
        self.step += 50
        return SimpleNamespace(value="SUCCEEDED" if self.step >= 400 else "RUNNING")

    # the run folder
    def live_folders(self):
        return {s: {MARKER} for s in range(50, self.step + 1, 50)}


class FakeProxy:
    def __init__(self, run: FakeRun):
        self.run = run
        self.injected = {"500": 0, "503": 0, "reset": 0, "latency": 0}

    def stats(self):
        return {"injected": dict(self.injected)}

    def open_window(self, kind, **window):
        self.run.events.append(f"window {kind} at {self.run.step}")
        self.injected[kind] += 1  # the next save meets it

    def set_rates(self, **rates):
        if rates:
            self.run.events.append(f"rates at {self.run.step}")
            self.injected["latency"] += 1

    def close_windows(self):
        pass


def test_outside_faults_fire_in_order_once_their_checkpoints_committed(monkeypatch):
    run = FakeRun()
    monkeypatch.setattr(soak_faults, "POLL_SECONDS", 0)
    monkeypatch.setattr(soak_faults.submit, "client", lambda target: run)
    monkeypatch.setattr(soak_faults.submit, "submit", lambda spec, target, **kw: Submitted(f"job-{run.step}", "r", "a"))
    monkeypatch.setattr(
        soak_faults.RunRecords, "store", lambda self, name: SimpleNamespace(live_folders=run.live_folders)
    )
    spec = load_job_spec(ROOT / "jobs" / "digits_ddp.yaml", ())
    faulted = soak_faults.FaultedRun(
        spec, Target("http://127.0.0.1:1", None), ROOT, "t", FakeProxy(run), lambda m: None, 1.0, 1.0
    )
    faults = [Fault(0, S3_SAVE_ERRORS, 120), Fault(1, SLOW_S3, 200), Fault(2, S3_SAVE_ERRORS, 10_000)]
    result = faulted.run(faults, [2])
    assert result.status == "SUCCEEDED" and result.job_ids == ["job-0"]
    # Fired at the first commit at or after its step; the next waited for a newer commit (its recovery).
    assert run.events == ["window 503 at 150", "rates at 250"]
    assert [f.fired for f in result.faults] == [True, True, False]
    assert result.faults[2].detail == "not fired: the run ended before it reached this step"
