"""The chaos soak's pure parts: seeded fault plans, goodput, the loss of noticed reclaims, the verdict."""

from __future__ import annotations

import pytest

from elastic.diagnostics.soak_plan import (
    DRIVER_KILLED,
    FAULT_KINDS,
    IN_WORKER,
    SAVE_KILL,
    draw_kinds,
    goodput,
    lost_steps_after,
    pacing,
    plan_faults,
    verdict,
)
from elastic.errors import UserError


def test_the_same_seed_draws_the_same_faults_and_nine_cover_every_kind():
    assert draw_kinds(20, seed=7) == draw_kinds(20, seed=7)
    assert draw_kinds(20, seed=7) != draw_kinds(20, seed=8)
    assert sorted(draw_kinds(9, seed=3)) == sorted(FAULT_KINDS)
    twenty = draw_kinds(20, seed=0)
    assert all(twenty.count(kind) >= 2 for kind in FAULT_KINDS)  # two full cycles, then two more


def test_a_job_streaming_from_a_bucket_also_draws_faults_on_its_data_reads():
    from elastic.config.spec import load_job_spec
    from elastic.diagnostics.soak import streamed_data_path
    from elastic.diagnostics.soak_plan import DATA_FAULT_KINDS, S3_DATA_READ_ERRORS

    assert sorted(draw_kinds(10, seed=3, kinds_drawn=DATA_FAULT_KINDS)) == sorted(DATA_FAULT_KINDS)
    assert S3_DATA_READ_ERRORS not in draw_kinds(20, seed=3)  # jobs with their data in memory: as before
    prefix = streamed_data_path(load_job_spec("jobs/charlm.yaml"))
    assert prefix == "/datasets/charlm-apache"
    assert prefix in "/elastic/datasets/charlm-apache-64-16/part-00000.parquet"  # the tokenized copy charlm reads
    assert streamed_data_path(load_job_spec("jobs/digits_ddp.yaml")) is None


def test_worker_count_changes_get_their_driver_kills():
    kinds = draw_kinds(3, seed=1, segments=3)
    assert kinds.count(DRIVER_KILLED) >= 2
    with pytest.raises(UserError, match="--faults 1 is too few for 3 worker counts"):
        draw_kinds(1, seed=1, segments=3)


def test_faults_land_evenly_with_save_kills_on_checkpoint_steps():
    faults = plan_faults(6, seed=5, final_step=700, every_steps=50, workers=2)
    assert [f.index for f in faults] == list(range(6))
    assert [f.step for f in faults if f.kind not in IN_WORKER] == [
        round((f.index + 1) * 700 / 7) for f in faults if f.kind not in IN_WORKER
    ]
    assert all(f.step % 50 == 0 for f in faults if f.kind == SAVE_KILL)
    in_worker = [f.step for f in faults if f.in_worker]
    assert len(in_worker) == len(set(in_worker)) and all(s < 700 for s in in_worker)
    assert all(0 <= f.rank < 2 for f in faults)


def test_a_run_too_short_for_the_faults_is_refused_with_the_numbers():
    with pytest.raises(UserError, match="takes 300 steps, the soak needs at least 1050"):
        plan_faults(20, seed=0, final_step=300, every_steps=50, workers=2)


def test_goodput_is_productive_over_wall_time_at_most_one():
    assert goodput(30.0, 120.0) == 0.25
    assert goodput(50.0, 40.0) == 1.0  # a faulted run cannot do better than the uninterrupted one
    with pytest.raises(ValueError):
        goodput(1.0, 0.0)


def test_lost_steps_are_counted_from_the_attempt_before_the_reclaim_to_the_resume_after_it():
    attempts = ["1000000000000", "2000000000000", "3000000000000"]  # started at t=1000, 2000, 3000 s
    last_step = {attempts[0]: 120, attempts[1]: 200, attempts[2]: 300}
    resumed_from = {attempts[0]: 0, attempts[1]: 120, attempts[2]: 150}
    assert lost_steps_after([1500.0], attempts, last_step, resumed_from) == 0  # just-in-time: nothing lost
    assert lost_steps_after([2500.0], attempts, last_step, resumed_from) == 50
    assert lost_steps_after([1500.0, 2500.0, 3500.0], attempts, last_step, resumed_from) == 50  # last: no resume


def test_verdict_names_each_failed_criterion():
    assert verdict(True, True, True, [], 6, 6, loss_within_tolerance=False) == []
    problems = verdict(True, False, False, ["attempt 1 loaded step 50 without a commit marker on record"], 6, 5, True)
    assert problems == [
        "final model and optimizer differ from the uninterrupted run's",
        "not every sample was trained on exactly once per epoch",
        "torn checkpoint loaded: attempt 1 loaded step 50 without a commit marker on record",
        "5 of 6 planned faults fired",
    ]
    # Across worker counts the weights legitimately differ; the loss bound holds instead.
    assert verdict(False, False, True, [], 3, 3, loss_within_tolerance=True) == []
    assert verdict(False, False, True, [], 3, 3, loss_within_tolerance=False) == [
        "per-epoch loss moved beyond the tolerance across worker counts"
    ]


def test_pacing_gives_each_fault_training_time_and_two_checkpoints_between_faults():
    every, pause = pacing(6, final_step=690, every_steps=50, seconds_per_fault=20.0)
    assert every == 49 and pause == round(6 * 20.0 / 690, 4)  # 120 s of training in all
    every, pause = pacing(20, final_step=276, every_steps=50, seconds_per_fault=20.0)
    assert every == 6 and plan_faults(20, 0, 276, every, workers=2)  # the default digits job fits 20 faults
    assert pacing(2, final_step=10_000, every_steps=50)[0] == 50  # never checkpoints less often than the job
