"""Unit tests for elastic/placement/policy.py: the pure spot-first policy, the start-up wait with a fake clock, the swap
watcher against a fake cluster, and the control objects in a run folder (local filesystem)."""

from __future__ import annotations

import pytest

from elastic import logs
from elastic.config.spec import WorkersSpec
from elastic.driver.capacity import GrowWatcher, SwapWatcher, wait_for_spot, wait_for_workers
from elastic.placement.control import PlacementControl
from elastic.placement.messages import EndKind
from elastic.placement.policy import NodeView, decide_grow, decide_start, decide_swap, decide_workers, worker_slots
from elastic.worker.placement_watch import NoPlacementWatch, PlacementWatch, placement_watch


@pytest.fixture(autouse=True)
def elastic_logs():
    """The driver logs through `logging`; configured as a job's driver is, its lines reach stdout."""
    logs.configure("INFO")


def node(
    market: str, cpus: float = 1.0, gpus: float = 0.0, role: str = "worker", draining: bool = False, node_id: str = "n"
) -> NodeView:
    available = {"CPU": cpus}
    if gpus:
        available["GPU"] = gpus
    return NodeView(
        node_id=node_id, labels={"market": market, "elastic-role": role}, available=available, draining=draining
    )


def workers(**fields) -> WorkersSpec:
    return WorkersSpec(**{"min": 2, "max": 2, "cpus": 1, "market": "spot-first", "spot_wait_seconds": 60, **fields})


# ---------------------------------------------------------------------------------------------------------
# worker_slots


def test_slots_count_only_free_worker_nodes_of_the_market():
    nodes = [node("spot", 2.0), node("spot", 0.5), node("on-demand", 4.0), node("spot", 8.0, role="head")]
    assert worker_slots(nodes, workers(), "spot") == 2
    assert worker_slots(nodes, workers(), "on-demand") == 4


def test_slots_an_ending_placement_releases_count_once():
    """The next placement is sized while the ending one's workers still hold their slots: those count as
    free, capped at the node's total so a slot already released is not counted twice; draining nodes never."""
    busy = NodeView(
        node_id="a", labels={"market": "spot", "elastic-role": "worker"}, available={"CPU": 0.0}, total={"CPU": 1.0}
    )
    freed = NodeView(
        node_id="b", labels={"market": "spot", "elastic-role": "worker"}, available={"CPU": 1.0}, total={"CPU": 1.0}
    )
    leaving = NodeView(
        node_id="c",
        labels={"market": "spot", "elastic-role": "worker"},
        available={"CPU": 0.0},
        total={"CPU": 1.0},
        draining=True,
    )
    spare = NodeView(
        node_id="d", labels={"market": "spot", "elastic-role": "worker"}, available={"CPU": 1.0}, total={"CPU": 1.0}
    )
    nodes = [busy, freed, leaving, spare]
    assert worker_slots(nodes, workers(), "spot") == 2  # b and d
    released = {"a": 1, "b": 1, "c": 1}
    assert worker_slots(nodes, workers(), "spot", released) == 3  # + a; b not twice; c is leaving
    sized = decide_workers(workers(min=1, max=4, market="spot"), nodes, "spot", released)
    assert (sized.action, sized.spot_slots) == ("start", 3)


def test_slots_are_limited_by_the_scarcest_resource():
    nodes = [node("spot", cpus=8.0, gpus=1.0), node("spot", cpus=1.0, gpus=4.0)]
    assert worker_slots(nodes, workers(cpus=1, gpus=1), "spot") == 2  # 1 GPU-bound + 1 CPU-bound
    assert worker_slots(nodes, workers(cpus=0.5, gpus=0.5), "spot") == 4  # 2 + 2


def test_fractional_resources_do_not_lose_a_slot_to_float_error():
    assert worker_slots([node("spot", cpus=0.1 * 3)], workers(cpus=0.1), "spot") == 3


def test_draining_nodes_do_not_count():
    nodes = [node("spot", 1.0), node("spot", 1.0, draining=True)]
    assert worker_slots(nodes, workers(), "spot") == 1


# ---------------------------------------------------------------------------------------------------------
# decide_start / decide_swap


def test_start_on_spot_when_spot_can_hold_min_workers():
    decision = decide_start(workers(min=2, max=4), [node("spot"), node("spot"), node("on-demand")], 0.0)
    assert decision.action == "spot" and decision.spot_slots == 2
    assert "spot capacity for 2 worker(s) is free" in decision.reason


def test_start_waits_for_spot_before_the_timeout():
    decision = decide_start(workers(), [node("spot"), node("on-demand"), node("on-demand")], 59.0)
    assert decision.action == "wait"
    assert "1 of 2 spot worker slot(s) free after 59 of 60 s" in decision.reason


def test_start_falls_back_to_on_demand_after_the_timeout_with_the_reason():
    decision = decide_start(workers(), [node("on-demand"), node("on-demand")], 60.0)
    assert decision.action == "on-demand"
    assert decision.reason == (
        "spot capacity was not granted within 60 s (0 of 2 spot worker slot(s) free); falling back to on-demand"
    )


def test_zero_wait_falls_back_at_once():
    assert decide_start(workers(spot_wait_seconds=0), [], 0.0).action == "on-demand"


def test_swap_when_spot_capacity_returns():
    assert decide_swap(workers(), [node("spot")]).action == "stay"
    decision = decide_swap(workers(), [node("spot"), node("spot", draining=True), node("spot")])
    assert decision.action == "swap" and "swapping at the next checkpoint" in decision.reason


def test_no_swap_when_swap_to_spot_is_off():
    decision = decide_swap(workers(swap_to_spot=False), [node("spot", 8.0)])
    assert decision.action == "stay" and decision.reason == "swap_to_spot is off"


# ---------------------------------------------------------------------------------------------------------
# wait_for_spot: the thin loop, with a fake clock and a fake cluster


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_for_spot_takes_spot_when_it_arrives_in_time(capsys):
    clock = FakeClock()
    arrivals = {20.0: [node("spot")], 30.0: [node("spot"), node("spot")]}

    def observe():
        return max(((t, n) for t, n in arrivals.items() if t <= clock.now), default=(0, []))[1]

    decision = wait_for_spot(workers(), observe=observe, clock=clock, sleep=clock.sleep, poll_seconds=10)
    assert decision.action == "spot" and clock.now == 30.0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[elastic] placement: wait: waiting for spot capacity: 0 of 2")
    assert out[-1].startswith("[elastic] placement: spot: ")
    assert len(out) == 2  # the wait is announced once, not on every poll


def test_wait_for_spot_falls_back_exactly_at_the_timeout():
    clock = FakeClock()
    decision = wait_for_spot(
        workers(spot_wait_seconds=25),
        observe=lambda: [node("on-demand")] * 2,
        clock=clock,
        sleep=clock.sleep,
        poll_seconds=10,
    )
    assert decision.action == "on-demand"
    assert clock.sleeps == [10, 10, 5] and clock.now == 25.0


def test_wait_for_spot_survives_a_failed_poll(capsys):
    clock = FakeClock()
    polls = iter([RuntimeError("GCS unavailable"), [node("spot"), node("spot")]])

    def observe():
        item = next(polls)
        if isinstance(item, Exception):
            raise item
        return item

    decision = wait_for_spot(workers(), observe=observe, clock=clock, sleep=clock.sleep, poll_seconds=5)
    assert decision.action == "spot" and clock.now == 5
    assert "capacity poll failed (RuntimeError: GCS unavailable)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------
# Control objects and the driver's watcher (a run folder on the local filesystem)


def test_control_objects_round_trip_and_ids_make_stale_ones_harmless(tmp_path):
    control = PlacementControl(str(tmp_path / "run"))
    assert not control.end_requested("p1") and control.ended("p1") is None
    control.request_end("p1", "swap", "because")
    assert control.end_requested("p1") and not control.end_requested("p2")
    assert control.end_request("p1").kind == EndKind.SWAP
    control.acknowledge("p1", 40, "swap")
    assert control.ended("p1").step == 40 and control.ended("p2") is None
    control.running("p1", 3)
    assert control.world_size("p1") == 3 and control.world_size("p2") is None
    control.clear()
    assert not control.end_requested("p1") and control.ended("p1") is None
    control.cancel_request()  # nothing to cancel: no error


def test_session_watch_polls_only_endable_placements_and_any_placement_can_end_itself(tmp_path):
    none = placement_watch(None, str(tmp_path), 0)
    assert isinstance(none, NoPlacementWatch) and not none.can_end  # Ray Train used without our driver
    fixed = placement_watch({"id": "q", "market": "spot", "swappable": False}, str(tmp_path), 0)
    PlacementControl(str(tmp_path)).request_end("q", "grow", "test")
    assert fixed.can_end and not fixed.end_requested()  # nothing may ask it to end...
    assert fixed.acknowledge(7, reason="preemption") == "a node is being reclaimed"  # ...but a reclaim ends it
    ended = PlacementControl(str(tmp_path)).ended("q")
    assert (ended.step, ended.kind) == (7, EndKind.PREEMPTION)
    watch = placement_watch({"id": "p", "market": "on-demand", "swappable": True}, str(tmp_path), 0)
    assert isinstance(watch, PlacementWatch) and not watch.end_requested()
    PlacementControl(str(tmp_path)).request_end("p", "swap", "test")
    assert watch.end_requested()  # no process group: rank 0's answer alone
    assert watch.acknowledge(12) == "moving to spot"
    assert PlacementControl(str(tmp_path)).ended("p").step == 12
    placement_watch({"id": "p", "swappable": True}, str(tmp_path), 1).acknowledge(99)  # only rank 0 writes
    assert PlacementControl(str(tmp_path)).ended("p").step == 12


def test_a_placement_started_ahead_waits_for_its_predecessor_or_a_cancel(tmp_path):
    """The next placement is started before the ending one's just-in-time checkpoint: its sessions read no
    checkpoint until the predecessor acknowledged its end, and exit if the driver calls it off."""
    import threading

    control = PlacementControl(str(tmp_path))
    ending = placement_watch({"id": "old", "market": "spot"}, str(tmp_path), 0)
    ending.rank_nodes = ["a", "b"]
    ending.will_end(eta=1234.5)
    notice = control.ending_soon("old")
    assert (notice.eta, notice.nodes) == (1234.5, ("a", "b")) and control.ending_soon("new") is None

    follower = PlacementWatch(control, "new", 0, endable=False, follows="old", poll_seconds=0.01)
    waited = {}
    thread = threading.Thread(target=lambda: waited.update(go=follower.wait_for_predecessor()))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # no acknowledgement yet: still waiting
    ending.acknowledge(40, reason="preemption")
    thread.join(5)
    assert waited == {"go": True}
    assert placement_watch({"id": "x"}, str(tmp_path), 0).wait_for_predecessor()  # not started ahead

    control.clear(keep_ended=True)  # the driver forgets the old placement but the follower may still look
    assert control.ended("old").step == 40 and control.ending_soon("old") is None
    control.clear()
    called_off = PlacementWatch(control, "new2", 0, endable=False, follows="old", poll_seconds=0.01)
    control.cancel("new2")
    assert control.cancelled("new2") and not control.cancelled("new")
    assert called_off.wait_for_predecessor() is False


def test_swap_watcher_requests_once_and_withdraws_if_spot_goes_away(tmp_path, capsys):
    control = PlacementControl(str(tmp_path))
    cluster = {"nodes": [node("on-demand"), node("on-demand")]}
    watcher = SwapWatcher(workers(), control, "p1", observe=lambda: cluster["nodes"])

    assert watcher.poll_once().action == "stay" and not control.end_requested("p1")
    cluster["nodes"] = cluster["nodes"] + [node("spot"), node("spot")]
    assert watcher.poll_once().action == "swap" and control.end_requested("p1")
    watcher.poll_once()  # still swap: no second request, no second log line
    cluster["nodes"] = cluster["nodes"][:2]
    watcher.poll_once()
    assert not control.end_requested("p1") and not watcher.requested
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[elastic] placement:")]
    assert len(lines) == 2 and "swap:" in lines[0] and "request withdrawn" in lines[1]


def test_swap_watcher_keeps_a_request_the_session_already_acknowledged(tmp_path):
    control = PlacementControl(str(tmp_path))
    cluster = {"nodes": [node("spot"), node("spot")]}
    watcher = SwapWatcher(workers(), control, "p1", observe=lambda: cluster["nodes"])
    watcher.poll_once()
    control.acknowledge("p1", 60, "swap")
    cluster["nodes"] = []  # the new placement took the spot nodes
    watcher.poll_once()
    assert control.end_requested("p1") and control.ended("p1").step == 60


@pytest.mark.parametrize("market", ["spot", "on-demand", "any"])
def test_other_markets_keep_their_defaults(market):
    spec = WorkersSpec(min=1, market=market)
    assert spec.spot_wait_seconds == 120 and spec.swap_to_spot is True


# ---------------------------------------------------------------------------------------------------------
# Drivers on the on-demand head; local add-node's edges


def test_driver_selector_matches_the_on_demand_head_only():
    from elastic.placement.labels import driver_selector, matches

    head = {"market": "on-demand", "elastic-role": "head", "elastic-node": "head"}
    assert matches(head, driver_selector())
    assert not matches({"market": "spot", "elastic-role": "head"}, driver_selector())
    assert not matches({"market": "on-demand", "elastic-role": "worker"}, driver_selector())
    assert not matches({}, driver_selector())


def test_add_node_needs_a_running_stack_and_a_known_market(tmp_path, monkeypatch):
    from elastic.errors import ClusterError
    from elastic.local import stack as local

    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path))
    with pytest.raises(ClusterError, match="no local stack running; start one with `elastic local up`"):
        local.add_node("spot")
    with pytest.raises(ClusterError, match="--market 'spott': use one of spot, on-demand"):
        local.add_node("spott")


# ---------------------------------------------------------------------------------------------------------
# Sizing a placement and growing it (elastic runs)


def test_any_market_counts_every_worker_node():
    nodes = [node("spot"), node("on-demand"), node("spot", role="head")]
    assert worker_slots(nodes, workers(), "any") == 2


def test_a_placement_starts_with_as_many_workers_as_fit_up_to_max_and_waits_below_min():
    elastic = workers(min=1, max=3, market="spot")
    nodes = [node("spot"), node("spot"), node("spot", draining=True), node("on-demand")]
    start = decide_workers(elastic, nodes, "spot")
    assert (start.action, start.spot_slots) == ("start", 2)  # the draining node is leaving: not counted
    assert decide_workers(elastic, nodes * 2, "spot").spot_slots == 3  # capped at max
    wait = decide_workers(workers(min=2, max=2, market="spot"), nodes[:1], "spot")
    assert wait.action == "wait" and "1 of 2 worker slot(s) free on spot nodes" in wait.reason


def test_waiting_for_workers_polls_until_a_replacement_joins_and_says_why(capsys):
    polls = iter([[node("spot")]] * 5 + [[node("spot"), node("spot")]])
    decision = wait_for_workers(
        workers(min=2, max=2, market="spot"), "spot", observe=lambda: next(polls), sleep=lambda s: None
    )
    assert decision.action == "start" and decision.spot_slots == 2
    out = capsys.readouterr().out
    assert "waiting for capacity: 1 of 2" in out and "start: 2 worker(s) on spot nodes" in out


def test_grow_only_below_max_and_with_a_free_slot():
    elastic = workers(min=1, max=2, market="spot")
    assert decide_grow(elastic, [node("spot")], "spot", running=1).action == "grow"
    assert decide_grow(elastic, [node("spot", cpus=0.0)], "spot", running=1).action == "stay"
    assert decide_grow(elastic, [node("spot")], "spot", running=2).action == "stay"
    assert decide_grow(elastic, [node("spot")], "spot", running=None).action == "stay"
    assert decide_grow(elastic, [node("on-demand")], "spot", running=1).action == "stay"


def test_grow_watcher_waits_for_a_steady_reading_and_never_flaps(tmp_path, capsys):
    control = PlacementControl(str(tmp_path))
    control.running("p1", 1)
    cluster = {"nodes": [node("spot")]}
    clock = FakeClock()
    watcher = GrowWatcher(
        workers(min=1, max=2, market="spot", regrow_after_seconds=10),
        control,
        "p1",
        "spot",
        observe=lambda: cluster["nodes"],
        clock=clock,
    )
    watcher.poll_once()
    clock.now = 6
    cluster["nodes"] = []  # the new node went away again: the clock restarts
    watcher.poll_once()
    clock.now = 8
    cluster["nodes"] = [node("spot")]
    watcher.poll_once()
    clock.now = 17
    watcher.poll_once()
    assert not control.end_requested("p1")  # 9 s steady, not 10
    clock.now = 18
    watcher.poll_once()
    assert control.end_request("p1").kind == EndKind.GROW
    clock.now = 19
    cluster["nodes"] = []
    watcher.poll_once()  # capacity gone before the checkpoint: withdrawn
    assert not control.end_requested("p1")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[elastic] placement:")]
    assert len(lines) == 2 and "growing 1 -> 2" in lines[0] and "request withdrawn" in lines[1]
