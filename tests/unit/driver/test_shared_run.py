"""A run submitted on a GPU share (0 < workers.gpus < 1): every placement carries the share and its memory cap,
and an out-of-memory marker from the workers makes the driver go on at a doubled share, up to a whole GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic.config.spec import load_job_spec
from elastic.driver import fitting
from elastic.errors import TrialOutOfMemory
from elastic.worker.sharing import OOM_FILE

ROOT = Path(__file__).resolve().parents[3]


class FakeExecutor:
    """Stands in for PlacementExecutor: records what each placement was given; runs out of memory below
    `fits_at` by writing the marker the workers write."""

    calls: list = []
    fits_at = 0.5

    def __init__(self, spec, run_name, run_uri, placements, sharing, ledger=None):
        self.spec, self.run_uri, self.sharing = spec, run_uri, sharing

    def run(self):
        FakeExecutor.calls.append((self.spec.workers.gpus, self.sharing.share, self.sharing.memory_fraction))
        if self.sharing.share < FakeExecutor.fits_at:
            Path(self.run_uri, OOM_FILE).write_text(json.dumps({"share": self.sharing.share, "step": 12}))
        return "result"


@pytest.fixture
def executor(monkeypatch):
    FakeExecutor.calls = []
    monkeypatch.setattr(fitting, "PlacementExecutor", FakeExecutor)
    return FakeExecutor


def spec(share: float):
    return load_job_spec(ROOT / "jobs" / "digits_ddp.yaml", (f"workers.gpus={share}", "workers.min=1"))


def test_an_oom_goes_on_at_a_doubled_share(executor, tmp_path):
    executor.fits_at = 0.5
    assert fitting.fit_shared_run(spec(0.25), "r", str(tmp_path), [], fitting.NoLedger()) == "result"
    assert executor.calls == [(0.25, 0.25, 0.25), (0.5, 0.5, 0.5)]
    assert not (tmp_path / OOM_FILE).exists()  # read and cleared


def test_no_oom_one_placement_sequence(executor, tmp_path):
    executor.fits_at = 0.0
    assert fitting.fit_shared_run(spec(0.5), "r", str(tmp_path), [], fitting.NoLedger()) == "result"
    assert executor.calls == [(0.5, 0.5, 0.5)]


def test_out_of_memory_on_a_whole_gpu_fails_the_run(executor, tmp_path):
    executor.fits_at = 2.0
    with pytest.raises(TrialOutOfMemory, match="share 1.0"):
        fitting.fit_shared_run(spec(0.5), "r", str(tmp_path), [], fitting.NoLedger())
    assert [c[1] for c in executor.calls] == [0.5, 1.0]


def test_gpus_auto_is_at_most_a_whole_gpu_until_probed():
    from elastic.placement.policy import worker_resources

    workers = spec(0.5).workers.model_copy(update={"gpus": "auto"})
    assert workers.gpus_at_most == 1.0 and worker_resources(workers) == {"CPU": 1.0, "GPU": 1.0}
    assert load_job_spec(ROOT / "jobs" / "digits_ddp.yaml", ("workers.gpus=auto",)).workers.gpus == "auto"


def test_gpus_auto_on_the_local_stacks_logical_gpus_is_refused_at_submit(tmp_path):
    from types import SimpleNamespace

    from elastic.driver.submit import Target, submit
    from elastic.errors import SpecError

    job = load_job_spec(ROOT / "jobs" / "digits_ddp.yaml", ("workers.gpus=auto",))
    target = Target("http://127.0.0.1:1", SimpleNamespace(logical_gpus=True))
    with pytest.raises(SpecError, match="logical GPUs have none .*give workers.gpus a fraction"):
        submit(job, target, working_dir=ROOT, check_bucket=False, spec_source="digits_ddp.yaml")


def test_an_auto_run_probes_then_trains_on_the_share_it_measured(monkeypatch):
    from elastic.driver import probe
    from elastic.placement.packing import GB

    fits = []
    monkeypatch.setattr(
        probe,
        "probe_run",
        lambda job, name, steps, say: (
            fits.append((job.workers.gpus, name, steps))
            or {"cuda": True, "peak_bytes": 15 * GB, "device_bytes": 80 * GB, "step_seconds": 0.01}
        ),
    )
    share, reason = probe.auto_share(spec(0.5).model_copy(), "r", print)
    assert fits == [(1.0, "r-probe", probe.PROBE_STEPS)]  # probed on a whole GPU
    assert share == 0.25 and "measured" in reason  # 15 GB x 1.15 + 0.5 GB context: 4 on 80 GB
    monkeypatch.setattr(probe, "probe_run", lambda *args: {"cuda": False, "step_seconds": 0.01})
    with pytest.raises(probe.UserError, match="measured none"):
        probe.auto_share(spec(0.5), "r", print)
