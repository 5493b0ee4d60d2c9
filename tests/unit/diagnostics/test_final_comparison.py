"""The verifier's final-state check (RunRecords.compare_final), on two runs' DCP checkpoints in a local folder:
equal states are identical; a run whose optimizer drifted (a resume that forgot its scheduler's lr) is caught,
with the tensors that differ and by how much. End to end, a job that forgets its scheduler fails verify-resume
(tests/integration/test_submit_digits.py, make test-extended)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from elastic.config.spec import load_job_spec
from elastic.diagnostics.records import RunRecords

ROOT = Path(__file__).resolve().parents[3]


def final_state(lr: float) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for _ in range(3):
        (model(torch.ones(2, 4)) ** 2).sum().backward()  # gradients that depend on the weights
        optimizer.step()
        optimizer.zero_grad()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def save_final(records: RunRecords, run: str, step: int, state: dict) -> None:
    store = records.store(run)
    dcp.save(state, checkpoint_id=store.path(step), no_dist=True)
    store.commit(step, world_size=1)


def make_records(tmp_path: Path) -> RunRecords:
    spec = load_job_spec(ROOT / "jobs" / "digits_ddp.yaml", [f"checkpoint.uri={tmp_path.as_uri()}"])
    return RunRecords(spec)


def test_equal_final_states_are_identical(tmp_path):
    records = make_records(tmp_path)
    save_final(records, "baseline", 12, final_state(lr=0.1))
    save_final(records, "interrupted", 12, final_state(lr=0.1))
    comparison = records.compare_final("baseline", "interrupted")
    assert comparison.identical and comparison.max_abs_diff == 0.0 and comparison.changed == []
    assert comparison.compared >= 4  # weight, bias and their momentum buffers at least


def test_a_drifted_optimizer_is_caught_naming_the_tensors_that_differ(tmp_path):
    records = make_records(tmp_path)
    save_final(records, "baseline", 12, final_state(lr=0.1))
    save_final(records, "forgetful", 12, final_state(lr=0.05))  # trained on at the wrong lr after a resume
    comparison = records.compare_final("baseline", "forgetful")
    assert not comparison.identical and comparison.max_abs_diff > 0.0
    assert any(name.startswith("model.") for name in comparison.changed), comparison.changed
    assert any(name.startswith("optim.") for name in comparison.changed), comparison.changed


def test_a_run_without_a_committed_checkpoint_is_never_identical(tmp_path):
    records = make_records(tmp_path)
    save_final(records, "baseline", 12, final_state(lr=0.1))
    comparison = records.compare_final("baseline", "never-saved")
    assert not comparison.identical and comparison.compared == 0 and comparison.max_abs_diff == float("inf")
