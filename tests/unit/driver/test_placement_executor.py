"""elastic/driver/placements.py without a cluster: fake trainers play the sessions (writing the control objects
a real placement's rank 0 writes) and fake capacity, so the executor's order of operations is checked: the
next placement started ahead of a reclaim, taking over at the acknowledgement, a controller error retried."""

from __future__ import annotations

import threading
import time

import pytest

from elastic.config.spec import JobSpec
from elastic.driver import capacity, placements
from elastic.observability.metrics import NoMetrics
from elastic.placement.control import ENDING_FILE, PlacementControl
from elastic.placement.messages import EndingSoon
from elastic.placement.policy import Decision, NodeView


def spec(**failure) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": "t",
            "entrypoint": "m:f",
            "workers": {"min": 2, "max": 2, "cpus": 1, "market": "spot"},
            "checkpoint": {"uri": "/tmp/ckpt", "every_steps": 10},
            "failure": failure,
        }
    )


class MemoryLedger:
    """The run ledger's writer, kept in memory."""

    def __init__(self):
        self.events: list = []

    def record(self, event) -> None:
        self.events.append(event)

    def flush(self) -> None:
        pass


class RecordingMetrics(NoMetrics):
    def __init__(self, calls: list):
        self.calls = calls

    def preemption(self) -> None:
        self.calls.append(("preemption",))

    def placement(self, market: str, workers: int) -> None:
        self.calls.append(("placement", market, workers))


class ScriptedTrainer:
    def __init__(self, fit):
        self._fit = fit

    def fit(self):
        return self._fit()


@pytest.fixture
def cluster(monkeypatch):
    """Two spot nodes whose slots are taken by the running placement (freed by its release)."""
    nodes = [
        NodeView(
            node_id=n, labels={"market": "spot", "elastic-role": "worker"}, available={"CPU": 0.0}, total={"CPU": 1.0}
        )
        for n in ("a", "b")
    ]
    monkeypatch.setattr(capacity, "observe_nodes", lambda: nodes)
    monkeypatch.setattr(capacity, "draining_nodes", lambda observe=None: ())
    monkeypatch.setattr(capacity, "hint_spot_demand", lambda workers, on=True: None)
    monkeypatch.setattr(
        capacity, "wait_for_workers", lambda workers, market, released=None, on_wait=None: Decision("start", "fits", 2)
    )
    return nodes


def test_a_noticed_reclaim_starts_the_next_placement_ahead_and_it_takes_over_at_the_acknowledgement(
    tmp_path, monkeypatch, cluster
):
    control = PlacementControl(str(tmp_path))
    built: list = []
    acknowledged = threading.Event()

    def first(placement):
        def fit():
            # Rank 0's reclaim notice, backdated past NOTICE_SETTLE_SECONDS: due and settled.
            notice = EndingSoon(placement.id, time.time() + 2, ("a", "b"), time=time.time() - 10)
            control._write(ENDING_FILE, notice)
            deadline = time.time() + 10
            while len(built) < 2 and time.time() < deadline:  # the next placement is started ahead
                time.sleep(0.05)
            control.acknowledge(placement.id, 40, "preemption", ["a", "b"])
            acknowledged.set()
            time.sleep(0.3)  # Ray's controller still shutting the ended placement down
            return "first"

        return fit

    def second(placement):
        def fit():
            assert placement.follows == built[0].id  # started ahead of the first one's end
            acknowledged.wait(10)
            return "done"

        return fit

    def build_trainer(spec_, run_name, placement, sharing=None):
        built.append(placement)
        return ScriptedTrainer((first if len(built) == 1 else second)(placement))

    monkeypatch.setattr(placements, "build_trainer", build_trainer)
    emitted: list[tuple] = []
    monkeypatch.setattr(placements, "run_metrics", lambda run_name: RecordingMetrics(emitted))
    records: list[dict] = []
    ledger = MemoryLedger()
    result = placements.PlacementExecutor(spec(), "run", str(tmp_path), records, ledger=ledger).run()
    assert result == "done" and len(built) == 2
    # The run ledger: both placements, the second started ahead (before the first ended), and how each ended.
    assert [(type(e).__name__, e.placement) for e in ledger.events] == [
        ("PlacementStarted", built[0].id),
        ("PlacementStarted", built[1].id),
        ("PlacementEnded", built[0].id),
        ("PlacementEnded", built[1].id),
    ]
    assert ledger.events[1].follows == built[0].id and ledger.events[1].cpus_per_worker == 1
    assert [(e.ended_by, e.step) for e in ledger.events[2:]] == [("preemption", 40), ("finished", None)]
    # Ray's metrics saw both placements' sizes (the second started ahead of the end) and one preemption.
    assert emitted == [("placement", "spot", 2), ("placement", "spot", 2), ("preemption",)]
    assert [(r["reason"], r.get("ended_at_step"), r.get("ended_by")) for r in records] == [
        ("workers.market is spot", 40, "preemption"),
        ("resumed after a reclaim at step 40", None, None),
    ]
    assert control.ended(built[0].id) is None  # cleared at the end of the run


def test_a_controller_error_starts_a_new_placement_within_max_failures(tmp_path, monkeypatch, cluster):
    from ray.train import ControllerError

    fits = iter([ControllerError(RuntimeError("worker group failed to start")), "done"])

    def build_trainer(spec_, run_name, placement, sharing=None):
        outcome = next(fits)

        def fit():
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return ScriptedTrainer(fit)

    monkeypatch.setattr(placements, "build_trainer", build_trainer)
    records: list[dict] = []
    assert placements.PlacementExecutor(spec(max_failures=1), "run", str(tmp_path), records).run() == "done"
    assert records[0]["ended_by"] == "controller error"
    assert records[1]["reason"] == "restarted after a controller error (ControllerError)"

    fits = iter([ControllerError(RuntimeError("again")), ControllerError(RuntimeError("and again"))])
    with pytest.raises(ControllerError):
        placements.PlacementExecutor(spec(max_failures=1), "run", str(tmp_path), []).run()
