"""The sample ledger and its replay: the effective history of a run with restarts, and the exactly-once check
that verify-resume reports. Ledgers are written by the real loader and sampler, on a local filesystem."""

from __future__ import annotations

import fsspec
import pytest
import torch
from torch.utils.data import TensorDataset

from elastic.data import ResumableLoader, ResumableSampler
from elastic.worker.audit import History, SampleLedger, check_exactly_once, read_history, torn_loads
from elastic.worker.chaos import Kill, format_plan, parse_plan

N, BATCH = 20, 3


def run_attempt(
    root: str,
    attempt: str,
    world: int,
    steps: int,
    resumed_from: int = 0,
    state: dict | None = None,
    flush_every: int = 2,
) -> dict:
    """Simulate one attempt of `world` ranks in lockstep: each rank's loader feeds its ledger; flush at
    'checkpoints'. Returns the loader state at the last flush (what a checkpoint would hold)."""
    fs = fsspec.filesystem("file")
    dataset = TensorDataset(torch.arange(N))
    loaders, ledgers = [], []
    for rank in range(world):
        ledger = SampleLedger(fs, root, rank, world, resumed_from, attempt, num_samples=N)
        sampler = ResumableSampler(N, BATCH, rank, world, seed=7)
        loader = ResumableLoader(dataset, sampler, observer=ledger.on_batch)
        if state:
            loader.load_state_dict(state)
        loaders.append(loader)
        ledgers.append(ledger)
    iterators = [iter(loader.epochs(10)) for loader in loaders]
    saved = state
    for step in range(resumed_from + 1, resumed_from + steps + 1):
        for it, ledger in zip(iterators, ledgers):
            next(it)
            ledger.on_step(step, {"loss": 1.0 / step})
        if step % flush_every == 0:
            for ledger in ledgers:
                ledger.flush(step)
            saved = loaders[0].state_dict()
    return saved


def test_uninterrupted_history_sees_every_sample_once_per_epoch(tmp_path):
    # 20 samples, 2 ranks x 3: 4 steps an epoch (the last one short); 12 steps = 3 epochs.
    run_attempt(str(tmp_path), "001", world=2, steps=12)
    history = read_history(fsspec.filesystem("file"), str(tmp_path))
    assert history.final_step == 12 and history.num_samples == N
    result = check_exactly_once(history, complete_epochs=3)
    assert result.ok, result.problems
    assert result.epochs_checked == 3
    assert set(history.epoch_losses()) == {0, 1, 2}


def test_restarts_and_a_resize_replay_into_an_exactly_once_history(tmp_path):
    root = str(tmp_path)
    # Attempt 1 (2 ranks) flushes at 2, 4, 6 and dies at step 7; the checkpoint at 6 never committed, so
    # attempt 2 (1 rank) resumes from 4 and runs on; its records supersede attempt 1's steps 5..7.
    fs = fsspec.filesystem("file")
    state_at_4 = run_attempt(root, "001", world=2, steps=4)
    run_attempt(root, "001b", world=2, steps=3, resumed_from=4, state=state_at_4)  # the doomed tail
    run_attempt(root, "002", world=1, steps=10, resumed_from=4, state=state_at_4)
    history = read_history(fs, root)
    assert history.attempts == ["001", "001b", "002"]
    assert {r.attempt for s, r in history.steps.items() if s > 4} == {"002"}
    result = check_exactly_once(history)
    assert result.ok, result.problems


def test_restores_record_the_commit_marker_they_loaded_and_torn_loads_are_named(tmp_path):
    root = str(tmp_path)
    fs = fsspec.filesystem("file")
    state_at_4 = run_attempt(root, "001", world=1, steps=5)
    # Restored attempts carry the loaded checkpoint's commit time and when the load began.
    ledger = SampleLedger(fs, root, 0, 1, resumed_from=4, attempt="002", num_samples=N)
    ledger.resumed_commit_time, ledger.load_started = 100.0, 101.0
    ledger.on_step(5, {"loss": 0.5})
    ledger.flush(5)
    history = read_history(fs, root)
    assert state_at_4 is not None and history.restores == {"002": (100.0, 101.0)}
    assert history.last_step == {"001": 4, "002": 5}  # attempt 1 flushed up to 4 (its step 5 was never flushed)
    assert torn_loads(history) == []
    history.restores["002"] = (102.5, 101.0)  # committed after the load began: the load saw a torn folder
    history.restores["003"], history.resumed_from["003"] = (None, 103.0), 4  # no marker at all
    assert torn_loads(history) == [
        "attempt 002 loaded step 4, committed 1.500 s later",
        "attempt 003 loaded step 4 without a commit marker on record",
    ]


def test_a_replayed_step_without_a_resume_shows_duplicates(tmp_path):
    """If a restart resumed from the wrong place (here: from 0 while the data position said step 4), the
    ledger sees samples twice; the check must catch it."""
    root = str(tmp_path)
    run_attempt(root, "001", world=2, steps=4)
    run_attempt(root, "002", world=2, steps=4, resumed_from=4, state=None)  # data restarted from scratch
    result = check_exactly_once(read_history(fsspec.filesystem("file"), root))
    assert not result.ok
    assert any("seen more than once" in p for p in result.problems), result.problems


def test_skipped_samples_and_missing_steps_are_named():
    history = History(num_samples=4)
    from elastic.worker.audit import StepRecord

    history.steps[1] = StepRecord(1, "a", 1, {0: [(0, [0, 1])]}, {0: 1.0})
    history.steps[3] = StepRecord(3, "a", 2, {0: [(1, [0])]}, {0: 1.0})
    result = check_exactly_once(history)
    assert not result.ok
    assert "no record of steps 2" in result.problems
    assert "steps 3 lack a record from some rank" in result.problems
    assert any(p.startswith("epoch 0: 2 samples never seen") for p in result.problems)


def test_empty_ledger_is_a_problem_not_a_pass(tmp_path):
    result = check_exactly_once(read_history(fsspec.filesystem("file"), str(tmp_path)))
    assert not result.ok and "ledger is empty" in result.problems[0]


def test_flush_without_attempt_id_refuses():
    ledger = SampleLedger(fsspec.filesystem("memory"), "/x", 0, 1, 0, attempt="")
    ledger.on_step(1, {})
    with pytest.raises(RuntimeError, match="session.restore"):
        ledger.flush(1)


def test_chaos_plan_round_trips_and_rejects_nonsense():
    plan = parse_plan("30:1, 45,40:0:save,60:0:notice,70:1:hang")
    assert plan == [
        Kill(30, 1),
        Kill(45, 0),
        Kill(40, 0, during_save=True),
        Kill(60, 0, notice=True),
        Kill(70, 1, hang=True),
    ]
    assert format_plan(plan) == "30:1,45:0,40:0:save,60:0:notice,70:1:hang"
    with pytest.raises(ValueError, match="STEP\\[:RANK\\[:save\\|notice\\|hang\\]\\]"):
        parse_plan("3:1:later")
    with pytest.raises(ValueError, match="read by rank 0"):
        parse_plan("3:1:notice")
