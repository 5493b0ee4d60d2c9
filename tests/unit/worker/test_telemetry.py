"""The session's metrics (elastic.worker.telemetry) with a recording metrics object, fake clocks and a local
run folder: what rank 0 emits per step and per commit, lost steps from the progress mark, GPU series only
where there is a GPU sampler, and the low-utilization line."""

from __future__ import annotations

import logging

import pytest

from elastic.checkpoint.checkpointer import SaveResult
from elastic.checkpoint.store import CheckpointStore
from elastic.config.spec import CheckpointSpec
from elastic.observability.gpu import GpuSample
from elastic.observability.metrics import NoMetrics
from elastic.observability.utilization import LowUtilizationWatch
from elastic.worker.telemetry import Telemetry, read_progress


class Recorder(NoMetrics):
    """Records every metrics call as (name, *args)."""

    enabled = True

    def __init__(self):
        self.calls: list[tuple] = []
        for name in ("steps", "goodput", "checkpoint_committed", "checkpoint_interval", "lost_steps", "gpu"):
            setattr(self, name, lambda *args, name=name: self.calls.append((name, *args)))

    def named(self, name):
        return [call[1:] for call in self.calls if call[0] == name]


class Clock:
    def __init__(self, now=0.0):
        self.now = now

    def __call__(self):
        return self.now


def telemetry(tmp_path, rank=0, gpu=None, every_steps=10, low=None):
    wall, mono = Clock(1000.0), Clock(0.0)
    recorder = Recorder()
    made = Telemetry(
        recorder,
        rank,
        CheckpointSpec(uri=str(tmp_path), every_steps=every_steps),
        CheckpointStore(str(tmp_path / "run")),
        samples_per_step=lambda: 64,
        gpu=gpu,
        low_utilization=low,
        wall_clock=wall,
        clock=mono,
    )
    return made, recorder, wall, mono


def test_rank_0_emits_step_time_samples_per_second_and_goodput(tmp_path):
    made, recorder, wall, mono = telemetry(tmp_path)
    for step in range(1, 5):
        mono.now += 0.5
        wall.now += 0.5
        made.on_step(step)
    assert recorder.calls == []  # the loop's thread only measures; the background thread publishes
    made.publish()
    # 4 steps; the first interval holds the restore, so it is no step time
    assert recorder.named("steps") == [(4, 4, [0.5, 0.5, 0.5], 128.0)]
    # 1.5 s of productive steps in the 2 s since the run started
    assert recorder.named("goodput") == [(pytest.approx(0.75),)]
    made.publish()  # nothing new: nothing published
    mono.now += 0.25
    made.on_step(5)
    made.publish()
    assert recorder.named("steps")[1:] == [(1, 5, [0.25], 256.0)]


def test_commits_emit_save_stall_time_and_the_expected_interval(tmp_path):
    made, recorder, wall, mono = telemetry(tmp_path, every_steps=10)
    for step in range(1, 12):
        mono.now += 0.2
        made.on_step(step)
    made.on_commit(SaveResult(step=10, committed=True, blocked_seconds=0.01, total_seconds=0.4, attempts=1))
    assert recorder.named("checkpoint_committed") == [(0.4, 0.01, 1000.0)]
    assert recorder.named("checkpoint_interval") == [(pytest.approx(2.0),)]  # 10 steps x 0.2 s
    assert made.goodput.productive_seconds == pytest.approx(10 * 0.2 - 0.01)


def test_other_ranks_emit_no_run_series(tmp_path):
    made, recorder, _, mono = telemetry(tmp_path, rank=1)
    mono.now += 1
    made.on_step(1)
    made.publish()
    made.on_commit(SaveResult(step=1, committed=True, blocked_seconds=0.0, total_seconds=0.1, attempts=1))
    assert made.resumed(0) == 0
    assert recorder.calls == []


def test_steps_past_the_restored_checkpoint_count_as_lost(tmp_path, caplog):
    made, recorder, _, _ = telemetry(tmp_path)
    made.step = 37
    made._write_mark(made.step)  # what the background thread does every few seconds
    assert read_progress(CheckpointStore(str(tmp_path / "run"))) == 37

    after_kill, recorder, _, _ = telemetry(tmp_path)
    with caplog.at_level(logging.INFO, logger="elastic.worker.telemetry"):
        assert after_kill.resumed(30) == 7
    assert recorder.named("lost_steps") == [(7,)]
    assert "7 step(s) since the checkpoint of step 30 were lost" in caplog.text
    # A resume from the very step reached (a just-in-time end, a finished run) lost nothing.
    assert telemetry(tmp_path)[0].resumed(37) == 0


class FakeGpu:
    def __init__(self, utilization):
        self.utilization = utilization

    def sample(self):
        return GpuSample(self.utilization, 2e9)


def test_gpu_series_and_the_low_utilization_line_come_only_from_a_gpu_sampler(tmp_path, caplog):
    cpu, recorder, _, _ = telemetry(tmp_path)
    assert cpu._gpu is None and recorder.named("gpu") == []

    made, recorder, _, _ = telemetry(tmp_path, gpu=FakeGpu(0.35), low=LowUtilizationWatch(0.7, 600))
    with caplog.at_level(logging.WARNING, logger="elastic.worker.telemetry"):
        for now in range(0, 1300, 5):
            made._sample_gpu(float(now))
    assert recorder.named("gpu")[0] == (0, 0.35, 2e9)
    lines = [r.getMessage() for r in caplog.records if "low GPU utilization" in r.getMessage()]
    assert lines == [
        "low GPU utilization: under 70% for 10 minutes (mean 35%); the run may be waiting on data, "
        "checkpoints or its neighbours"
    ]
