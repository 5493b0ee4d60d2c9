"""PinningPBT (elastic/sweep/pbt.py): before PBT's exploit goes ahead, the donor's checkpoint it clones is pinned
in the donor's run under the recipient's run name, so the donor's retention keeps it until the copy."""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

from ray.tune import Checkpoint
from ray.tune.schedulers import PopulationBasedTraining

from elastic.checkpoint.store import CheckpointStore
from elastic.sweep import tune_reports
from elastic.sweep.pbt import PinningPBT


@dataclass(frozen=True)
class FakeTrial:
    trial_id: str


def test_the_exploit_pins_the_donors_checkpoint_for_the_recipient(tmp_path, monkeypatch):
    donor_run = tmp_path / "runs" / "sw-a"
    pointer_dir = tmp_path / "tune" / "checkpoint_000003"
    pointer_dir.mkdir(parents=True)
    found = tune_reports.pointer("sw-a", str(donor_run), f"{donor_run}/step-000000030")
    (pointer_dir / tune_reports.POINTER_FILE).write_text(json.dumps(found))
    calls = []
    monkeypatch.setattr(PopulationBasedTraining, "_exploit", lambda self, *args: calls.append(args))
    pbt = PinningPBT(
        run_name_of=lambda trial_id: f"sw-{trial_id}",
        time_attr="training_iteration",
        perturbation_interval=2,
        hyperparam_mutations={"lr": [0.1, 0.01]},
    )
    donor, recipient = FakeTrial("a"), FakeTrial("b")
    pbt._trial_state = {donor: SimpleNamespace(last_checkpoint=Checkpoint.from_directory(str(pointer_dir)))}
    pbt._exploit("controller", recipient, donor)
    assert calls == [("controller", recipient, donor)]  # PBT's own exploit still runs
    assert CheckpointStore(str(donor_run)).pinned_steps() == {found["step"]} == {30}
    assert (donor_run / "pins" / "sw-b.json").exists()


def test_an_unreadable_checkpoint_does_not_stop_the_exploit(monkeypatch):
    calls = []
    monkeypatch.setattr(PopulationBasedTraining, "_exploit", lambda self, *args: calls.append(args))
    pbt = PinningPBT(run_name_of=str, time_attr="training_iteration", hyperparam_mutations={"lr": [0.1, 0.01]})
    donor = FakeTrial("a")
    pbt._trial_state = {donor: SimpleNamespace(last_checkpoint=None)}
    pbt._exploit("controller", FakeTrial("b"), donor)
    assert len(calls) == 1
