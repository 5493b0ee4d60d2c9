"""Accounting on hand-built ledgers with known answers: every second of wall time goes to one cause, lost
steps come from where the next worker group resumed, GPU-hours and cost from placements and price tables."""

from __future__ import annotations

import pytest

from elastic.accounting.goodput import account
from elastic.accounting.prices import default_prices, load_prices
from elastic.accounting.usage import placements, usage
from elastic.errors import UserError
from elastic.ledger.events import (
    AttemptEnded,
    CapacityWaited,
    CheckpointCommitted,
    NodeDied,
    PlacementEnded,
    PlacementStarted,
    PreemptionNotice,
    Restored,
    RunEnded,
    RunStarted,
    Steps,
    WorkersStarted,
)


def spot_node(node_id: str, instance_type: str = "g5.xlarge") -> dict:
    return {"node_id": node_id, "market": "spot", "instance_type": instance_type, "node_cpus": 4, "node_gpus": 1}


def noticed_reclaim() -> list:
    """2 spot workers, a notice at step 90, the just-in-time checkpoint of step 100 (t=40..43), the next
    placement started ahead at t=38 resumes from step 100 on other nodes and finishes at step 200."""
    return sorted(
        [
            RunStarted(0.0, run="r"),
            PlacementStarted(2.0, placement="p1", market="spot", workers=2, cpus_per_worker=1, gpus_per_worker=1),
            WorkersStarted(
                8.0,
                attempt="a",
                placement="p1",
                world_size=2,
                cpus_per_worker=1,
                gpus_per_worker=1,
                nodes=[spot_node("n1"), spot_node("n2")],
            ),
            Steps(10.0, attempt="a", ended=20.0, first_step=1, last_step=50, metrics={"loss": 2.0}),
            CheckpointCommitted(20.0, attempt="a", committed=22.0, step=50, reason="periodic", save_s=2, stall_s=1),
            Steps(20.0, attempt="a", ended=40.0, first_step=51, last_step=100, metrics={"loss": 1.0}),
            PreemptionNotice(35.0, attempt="a", step=90, node_ids=["n1"], deadline=50.0),
            PlacementStarted(38.0, placement="p2", market="spot", workers=2, cpus_per_worker=1, gpus_per_worker=1),
            CheckpointCommitted(40.0, attempt="a", committed=43.0, step=100, reason="just-in-time", stall_s=3),
            WorkersStarted(
                42.0,
                attempt="b",
                placement="p2",
                world_size=2,
                cpus_per_worker=1,
                gpus_per_worker=1,
                nodes=[spot_node("n3"), spot_node("n2")],
            ),
            AttemptEnded(44.0, attempt="a", step=100, reason="preemption"),
            PlacementEnded(44.0, placement="p1", ended_by="preemption", step=100),
            Restored(45.0, attempt="b", ended=47.0, step=100, from_world_size=2, world_size=2),
            Steps(47.0, attempt="b", ended=67.0, first_step=101, last_step=200, metrics={"loss": 0.5}),
            NodeDied(50.0, node_id="n1"),
            CheckpointCommitted(67.0, attempt="b", committed=69.0, step=200, reason="final", stall_s=2),
            AttemptEnded(69.0, attempt="b", step=200, reason="finished"),
            PlacementEnded(71.0, placement="p2", ended_by="finished"),
            RunEnded(72.0, status="SUCCEEDED"),
        ],
        key=lambda e: e.time,
    )


def test_a_noticed_reclaim_loses_nothing_and_every_second_has_one_cause():
    result = account(noticed_reclaim())
    assert result.wall_s == 72.0
    assert result.productive_s == pytest.approx(49.0)
    assert result.badput == pytest.approx(
        {
            "startup": 10.0,
            "waiting_for_capacity": 0.0,
            "restore": 2.0,
            "checkpoint_stall": 6.0,
            "data_wait": 0.0,
            "lost_work_redone": 0.0,
            "preemption_gap": 2.0,
            "failure_recovery": 0.0,
            "hang": 0.0,
            "other": 3.0,
        }
    )
    assert result.lost_steps == 0 and result.steps == 200
    assert result.goodput == pytest.approx(49 / 72)


def hard_kill(node_died: bool) -> list:
    """Attempt a commits step 50 at t=20 and trains to step 80 by t=30, then dies without notice; attempt b
    restores step 50 (t=40..42) and trains 51..100 again."""
    events = [
        RunStarted(0.0, run="r"),
        Steps(10.0, attempt="a", ended=20.0, first_step=1, last_step=50),
        CheckpointCommitted(20.0, attempt="a", committed=21.0, step=50, reason="periodic", stall_s=0.5),
        Steps(20.0, attempt="a", ended=30.0, first_step=51, last_step=80),
        Restored(40.0, attempt="b", ended=42.0, step=50, from_world_size=2, world_size=2),
        Steps(42.0, attempt="b", ended=62.0, first_step=51, last_step=100),
        AttemptEnded(62.0, attempt="b", step=100, reason="finished"),
        RunEnded(63.0, status="SUCCEEDED"),
    ]
    if node_died:
        events.append(NodeDied(31.0, node_id="n1"))
    return sorted(events, key=lambda e: e.time)


@pytest.mark.parametrize("node_died, gap", [(True, "preemption_gap"), (False, "failure_recovery")])
def test_a_hard_kill_redoes_the_steps_after_the_last_commit(node_died, gap):
    result = account(hard_kill(node_died))
    assert result.lost_steps == 30
    assert result.wall_s == 63.0
    assert result.productive_s == pytest.approx(30.0)
    assert result.badput["lost_work_redone"] == pytest.approx(9.5)
    assert result.badput["checkpoint_stall"] == pytest.approx(0.5)
    assert result.badput[gap] == pytest.approx(10.0)
    assert result.badput["startup"] == 10.0 and result.badput["restore"] == 2.0 and result.badput["other"] == 1.0
    assert result.productive_s + sum(result.badput.values()) == pytest.approx(result.wall_s)


def test_a_window_partly_past_the_resume_point_is_redone_in_proportion():
    events = [
        RunStarted(0.0, run="r"),
        Steps(0.0, attempt="a", ended=10.0, first_step=1, last_step=10),  # resumed from 6: 7..10 redone
        Restored(12.0, attempt="b", ended=13.0, step=6, from_world_size=1, world_size=1),
        Steps(13.0, attempt="b", ended=20.0, first_step=7, last_step=20),
        RunEnded(20.0, status="SUCCEEDED"),
    ]
    result = account(events)
    assert result.lost_steps == 4
    assert result.badput["lost_work_redone"] == pytest.approx(4.0)
    assert result.productive_s == pytest.approx(6.0 + 7.0)


def test_resubmitted_jobs_add_their_own_wall_time_and_capacity_waits_count():
    events = [
        RunStarted(0.0, run="r"),
        CapacityWaited(1.0, ended=5.0, market="spot", reason="0 of 2 slots free"),
        Steps(6.0, attempt="a", ended=10.0, first_step=1, last_step=10),
        AttemptEnded(10.0, attempt="a", step=10, reason="finished"),
        RunEnded(11.0, status="SUCCEEDED"),
        # an hour later, the same run submitted again (it resumes): the hour between is not the run's
        RunStarted(3600.0, run="r"),
        Restored(3602.0, attempt="b", ended=3603.0, step=10, from_world_size=1, world_size=1),
        Steps(3603.0, attempt="b", ended=3607.0, first_step=11, last_step=20),
        # no RunEnded: that driver died; its time ends at its last event
    ]
    result = account(events)
    assert result.segments == [(0.0, 11.0), (3600.0, 3607.0)]
    assert result.wall_s == 18.0
    assert result.badput["waiting_for_capacity"] == 4.0
    assert result.badput["startup"] == pytest.approx(2.0 + 2.0)  # 0..1, 5..6 and 3600..3602
    assert result.badput["other"] == 1.0
    assert result.productive_s == 8.0 and result.lost_steps == 0


def test_gpu_hours_node_hours_and_cost_by_market():
    spans = placements(noticed_reclaim())
    assert [(s.id, s.started, s.ended, s.ended_by, s.step) for s in spans] == [
        ("p1", 2.0, 44.0, "preemption", 100),
        ("p2", 38.0, 71.0, "finished", None),
    ]
    used = usage(spans, default_prices())
    spot_hours = (2 * 42 + 2 * 33) / 3600
    assert used.gpu_hours == pytest.approx({"spot": spot_hours, "on-demand": 0.0}, abs=1e-6)
    assert used.node_hours["spot"] == pytest.approx(spot_hours, abs=1e-6)
    assert used.cost["actual"] == pytest.approx(spot_hours * 0.40, abs=1e-6)
    assert used.cost["all_on_demand"] == pytest.approx(spot_hours * 1.006, abs=1e-6)
    assert used.cost["savings"] == pytest.approx(spot_hours * (1.006 - 0.40), abs=1e-6)
    assert used.unpriced_node_hours == 0.0


def test_a_worker_on_a_shared_node_pays_its_share_and_unknown_types_stay_unpriced():
    events = [
        PlacementStarted(0.0, placement="", market="on-demand", workers=1, cpus_per_worker=0.5, gpus_per_worker=0.25),
        WorkersStarted(
            1.0,
            attempt="a",
            placement=None,
            world_size=1,
            cpus_per_worker=0.5,
            gpus_per_worker=0.25,
            nodes=[
                {"node_id": "x", "market": "on-demand", "instance_type": "g5.xlarge", "node_cpus": 4, "node_gpus": 1}
            ],
        ),
        PlacementEnded(3600.0, placement="", ended_by="finished"),
        PlacementStarted(3600.0, placement="q", market="spot", workers=1, cpus_per_worker=1, gpus_per_worker=0),
        WorkersStarted(
            3601.0,
            attempt="b",
            placement="q",
            world_size=1,
            cpus_per_worker=1,
            gpus_per_worker=0,
            nodes=[{"node_id": "y", "market": "spot", "instance_type": "", "node_cpus": 2, "node_gpus": 0}],
        ),
        PlacementEnded(7200.0, placement="q", ended_by="finished"),
    ]
    used = usage(placements(events), default_prices())
    assert used.gpu_hours == {"spot": 0.0, "on-demand": 0.25}
    assert used.node_hours == {"spot": 0.5, "on-demand": 0.25}
    assert used.cost["actual"] == pytest.approx(0.25 * 1.006) and used.cost["savings"] == 0.0
    assert used.unpriced_node_hours == 0.5


def test_a_prices_file_overrides_the_built_in_table(tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text(
        "source: our rates\ninstance_types:\n  g5.xlarge: {on-demand: 2.0, spot: 0.5}\n  local.cpu: {on-demand: 0.1, spot: 0.03}\n"
    )
    table = load_prices(prices)
    assert table.price("g5.xlarge", "spot") == 0.5 and table.price("local.cpu", "on-demand") == 0.1
    assert table.price("g6.xlarge", "on-demand") == default_prices().price("g6.xlarge", "on-demand")
    assert table.describe()["source"] == "our rates" and table.overrides == ["g5.xlarge", "local.cpu"]


def test_a_bad_prices_file_is_one_line_naming_the_field(tmp_path):
    prices = tmp_path / "prices.yaml"
    prices.write_text("instance_types:\n  g5.xlarge: {on-demand: 2.0, spto: 0.5}\n")
    with pytest.raises(UserError) as caught:
        load_prices(prices)
    message = str(caught.value)
    assert "\n" not in message and "instance_types.g5.xlarge" in message and str(prices) in message
    with pytest.raises(UserError, match="cannot read"):
        load_prices(tmp_path / "missing.yaml")


def test_a_hung_attempt_is_its_own_badput_cause_until_the_watchdog_ends_it():
    """Attempt a commits step 50 at t=20, trains to step 80 by t=30, then hangs until the watchdog ends it at
    t=50; attempt b restores step 50 at t=60 and trains 51..100 again."""
    events = [
        RunStarted(0.0, run="r"),
        Steps(10.0, attempt="a", ended=20.0, first_step=1, last_step=50),
        CheckpointCommitted(20.0, attempt="a", committed=21.0, step=50, reason="periodic", stall_s=0.5),
        Steps(20.0, attempt="a", ended=30.0, first_step=51, last_step=80),
        AttemptEnded(50.0, attempt="a", step=80, reason="hang"),
        Restored(60.0, attempt="b", ended=62.0, step=50, from_world_size=2, world_size=2),
        Steps(62.0, attempt="b", ended=82.0, first_step=51, last_step=100),
        AttemptEnded(82.0, attempt="b", step=100, reason="finished"),
        RunEnded(83.0, status="SUCCEEDED"),
    ]
    result = account(events)
    assert result.badput["hang"] == pytest.approx(20.0)  # t=30 (last step) .. t=50 (the watchdog's end)
    assert result.badput["failure_recovery"] == pytest.approx(10.0)  # t=50 .. t=60 (the restart)
    assert result.lost_steps == 30
    assert result.productive_s + sum(result.badput.values()) == pytest.approx(result.wall_s)
    assert any(cause == "hang" for _, _, cause in result.pieces)


def test_waiting_for_data_is_taken_out_of_productive_time_and_an_input_bound_run_says_what_to_change():
    """Two windows of 10 s with 3 s and 1 s of data wait; the second window is re-done after a kill, so its
    wait is lost work, not data wait."""
    from elastic.accounting.report import input_bound

    events = [
        RunStarted(0.0, run="r"),
        Steps(10.0, attempt="a", ended=20.0, first_step=1, last_step=50, data_wait_s=3.0),
        CheckpointCommitted(20.0, attempt="a", committed=21.0, step=50, reason="periodic", stall_s=0.0),
        Steps(20.0, attempt="a", ended=30.0, first_step=51, last_step=80, data_wait_s=1.0),
        Restored(40.0, attempt="b", ended=42.0, step=50, from_world_size=2, world_size=2),
        Steps(42.0, attempt="b", ended=62.0, first_step=51, last_step=100, data_wait_s=0.5),
        AttemptEnded(62.0, attempt="b", step=100, reason="finished"),
        RunEnded(63.0, status="SUCCEEDED"),
    ]
    result = account(events)
    assert result.badput["data_wait"] == pytest.approx(3.5)
    assert result.productive_s == pytest.approx(30.0 - 3.5)
    assert result.productive_s + sum(result.badput.values()) == pytest.approx(result.wall_s)
    bound = input_bound(result.productive_s, result.badput["data_wait"])
    assert bound["share_of_step_time"] == pytest.approx(3.5 / 30.0, abs=1e-4) and "prefetch" in bound["advice"]
    assert input_bound(100.0, 4.0) is None  # under 5% of step time: not input-bound
