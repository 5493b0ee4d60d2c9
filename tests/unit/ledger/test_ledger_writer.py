"""The run ledger on a local folder: writers never touch each other's objects, segments roll over, a torn line
is skipped, and rank 0's attempt ledger turns steps and saves into contiguous windows and commits."""

from __future__ import annotations

from elastic.checkpoint.checkpointer import SaveResult
from elastic.ledger import LedgerWriter, read_ledger
from elastic.ledger.events import CheckpointCommitted, PlacementStarted, RunStarted, Steps
from elastic.worker.run_ledger import AttemptLedger


def test_two_writers_append_side_by_side_and_read_back_in_time_order(tmp_path):
    driver = LedgerWriter(str(tmp_path), "driver", flush_seconds=60, segment_events=2)
    worker = LedgerWriter(str(tmp_path), "worker", flush_seconds=60)
    driver.record(RunStarted(10.0, run="r"))
    worker.record(Steps(12.0, attempt="a", ended=13.0, first_step=1, last_step=5))
    driver.record(PlacementStarted(11.0, placement="p", market="spot", workers=2))
    driver.flush()
    driver.record(PlacementStarted(14.0, placement="q", market="spot", workers=1))  # a second segment
    driver.close()
    worker.close()

    files = sorted(p.name for p in (tmp_path / "ledger").iterdir())
    assert len(files) == 3 and sum("-driver-" in f for f in files) == 2
    events = read_ledger(str(tmp_path))
    assert [type(e).__name__ for e in events] == ["RunStarted", "PlacementStarted", "Steps", "PlacementStarted"]
    assert events[2] == Steps(12.0, attempt="a", ended=13.0, first_step=1, last_step=5)


def test_a_torn_line_and_unknown_kinds_are_skipped(tmp_path):
    writer = LedgerWriter(str(tmp_path), "driver", flush_seconds=60)
    writer.record(RunStarted(1.0, run="r"))
    writer.close()
    (tmp_path / "ledger" / "0-other-x-0000.jsonl").write_text(
        '{"kind": "from_the_future", "time": 2}\n{"kind": "run_ended", "time": 3, "status": "SUCC'
    )
    assert [type(e).__name__ for e in read_ledger(str(tmp_path))] == ["RunStarted"]


def test_no_ledger_folder_reads_as_empty(tmp_path):
    assert read_ledger(str(tmp_path / "nothing")) == []


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_attempt_windows_close_at_saves_and_every_window_seconds(tmp_path):
    clock = Clock()
    writer = LedgerWriter(str(tmp_path), "worker", flush_seconds=60)
    attempt = AttemptLedger(writer, "p1", clock=clock)
    attempt.restoring()
    clock.now = 102.0
    attempt.restored(50, 2, 2)
    attempt.training()
    for step in range(51, 61):  # 1 s per step: the window closes after 10 s
        clock.now += 1.0
        attempt.stepped(step, {"loss": 1.0 / step, "note": "x"})
    clock.now += 1.0
    attempt.stepped(61, None)
    attempt.saving(61, asynchronous=True, reason="periodic")
    clock.now += 2.0
    attempt.committed(SaveResult(61, True, blocked_seconds=0.25, total_seconds=2.0, attempts=1))
    clock.now += 1.0
    attempt.stepped(62, {"loss": 0.5})
    attempt.ended(62, "finished")
    attempt.close()

    events = read_ledger(str(tmp_path))
    windows = [e for e in events if isinstance(e, Steps)]
    assert [(w.time, w.ended, w.first_step, w.last_step) for w in windows] == [
        (102.0, 112.0, 51, 60),
        (112.0, 113.0, 61, 61),
        (113.0, 116.0, 62, 62),
    ]
    assert windows[0].metrics == {"loss": 1.0 / 60}
    (commit,) = [e for e in events if isinstance(e, CheckpointCommitted)]
    assert (commit.time, commit.committed, commit.step, commit.stall_s, commit.reason) == (
        113.0,
        115.0,
        61,
        0.25,
        "periodic",
    )
    restored = [e for e in events if type(e).__name__ == "Restored"][0]
    assert (restored.time, restored.ended, restored.step) == (100.0, 102.0, 50)


def test_a_synchronous_save_stalls_the_loop_until_it_commits(tmp_path):
    clock = Clock()
    attempt = AttemptLedger(LedgerWriter(str(tmp_path), "worker", flush_seconds=60), None, clock=clock)
    attempt.training()
    clock.now += 1.0
    attempt.stepped(1, None)
    attempt.saving(1, asynchronous=False, reason="just-in-time")
    clock.now += 3.0
    attempt.committed(SaveResult(1, True, blocked_seconds=0.0, total_seconds=2.5, attempts=1))
    attempt.close()
    (commit,) = [e for e in read_ledger(str(tmp_path)) if isinstance(e, CheckpointCommitted)]
    assert commit.stall_s == 3.0 and commit.reason == "just-in-time"


def test_a_hung_attempt_stops_its_steps_at_the_last_step_and_ends_when_the_watchdog_fires(tmp_path):
    from elastic.ledger.events import AttemptEnded

    clock = Clock()
    attempt = AttemptLedger(LedgerWriter(str(tmp_path), "worker", flush_seconds=60), None, clock=clock)
    attempt.training()
    for step in range(1, 4):
        clock.now += 1.0
        attempt.stepped(step, None)
    clock.now += 15.0  # no step since 103: the watchdog fires at 118
    attempt.hung(3)
    attempt.close()
    events = read_ledger(str(tmp_path))
    assert [(w.ended, w.last_step) for w in events if isinstance(w, Steps)] == [(103.0, 3)]
    assert [(e.time, e.step, e.reason) for e in events if isinstance(e, AttemptEnded)] == [(118.0, 3, "hang")]
