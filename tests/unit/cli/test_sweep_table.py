"""The sweep's final table: a PBT sweep's trials show whom they cloned, at which step."""

from __future__ import annotations

from elastic.cli.sweep import _show_sweep


def trial(trial_id: str, exploits: list[dict]) -> dict:
    return {"trial_id": trial_id, "params": {"lr": 0.01}, "metric": 0.5, "state": "TERMINATED", "iterations": 9,
            "gpu_share": 0.25, "restarts": 0, "exploits": exploits}  # fmt: skip


def result(trials: list[dict]) -> dict:
    plan = {"trials_per_gpu": 4, "share": 0.25, "reason": "gpu_share 0.25"}
    return {"trials": trials, "metric": "mean_loss", "mode": "min", "plan": plan, "best_metric": 0.5,
            "best_config": {"lr": 0.01}}  # fmt: skip


def test_a_pbt_sweep_shows_each_trials_lineage(capsys):
    exploit = {"from": "digits-pbt-ab12c_00001", "step": 40}
    _show_sweep(result([trial("ab12c_00000", [exploit]), trial("ab12c_00001", [])]))
    out = capsys.readouterr().out
    assert "cloned" in out and "ab12c_00001@40" in out


def test_other_sweeps_have_no_lineage_column(capsys):
    _show_sweep(result([trial("ab12c_00000", [])]))
    assert "cloned" not in capsys.readouterr().out
