"""Unit tests for elastic/worker/jit.py: when the just-in-time checkpoint is planned, from a fake clock and notices."""

from __future__ import annotations

from elastic.worker.jit import DEFAULT_SAVE_SECONDS, JitPlanner, JustInTime, NoJustInTime, Notice


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def steps(planner: JitPlanner, clock: Clock, count: int, seconds: float) -> None:
    for _ in range(count):
        clock.now += seconds
        planner.stepped()


def test_planner_trains_on_while_a_step_a_save_and_the_margin_still_fit():
    clock = Clock()
    planner = JitPlanner(margin_seconds=2.0, clock=clock)
    steps(planner, clock, 5, 0.5)
    planner.saved(1.0)
    steps(planner, clock, 3, 0.5)
    notice = Notice(deadline=clock.now + 10.0, node_ids=("n1",))
    # 2 steps (1 s) + save (1 s) + margin (2 s) = 4 s < 10 s: keep training
    assert not planner.save_now(notice)
    clock.now += 5.9
    assert not planner.save_now(notice)  # 4.1 s left
    clock.now += 0.2
    assert planner.save_now(notice)  # 3.9 s left: save at the next step
    assert planner.save_now(Notice(deadline=None, node_ids=("n1",)))  # no deadline: at once


def test_planner_counts_a_save_in_flight_and_assumes_a_slow_save_before_any_was_timed():
    clock = Clock()
    planner = JitPlanner(margin_seconds=1.0, clock=clock)
    steps(planner, clock, 3, 0.1)
    assert planner.save_seconds == DEFAULT_SAVE_SECONDS
    notice = Notice(deadline=clock.now + DEFAULT_SAVE_SECONDS + 1.5, node_ids=("n",))
    assert not planner.save_now(notice)
    planner.saved(2.0)
    assert not planner.save_now(notice, in_flight_seconds=2.0)
    assert planner.save_now(notice, in_flight_seconds=6.0)


def test_save_estimate_decays_so_one_slow_save_does_not_cost_steps_forever():
    planner = JitPlanner(margin_seconds=0.0, clock=Clock())
    planner.saved(10.0)
    for _ in range(10):
        planner.saved(1.0)
    assert 1.0 <= planner.save_seconds < 1.5


def test_just_in_time_agrees_one_step_late_and_saves_once_planned():
    clock = Clock()
    notices = {"current": None}
    lines = []
    jit = JustInTime(
        rank=0, group=None, margin_seconds=1.0, log=lines.append, read_notice=lambda: notices["current"], clock=clock
    )
    due = []
    for step in range(1, 30):
        clock.now += 0.5
        if step == 10:
            notices["current"] = Notice(deadline=clock.now + 8.0, node_ids=("abcdef0123456789",))
        if jit.due(step):
            due.append(step)
            jit.saved(1.0)
    # deadline at t(10)+8 s; at step s, now = t(10) + (s-10)*0.5; planned when 2*0.5 + 5 (default save) + 1 >= left
    assert due == [13]
    assert len(lines) == 1 and "preemption notice for node(s) abcdef012345 at step 10" in lines[0]


def test_an_unreadable_ray_context_turns_jit_off_once_with_a_line():
    lines = []

    def unreadable():
        raise AttributeError("no preemption_context")

    jit = JustInTime(rank=0, group=None, margin_seconds=1.0, log=lines.append, read_notice=unreadable)
    assert not any(jit.due(step) for step in range(1, 5))
    assert len(lines) == 1 and "just-in-time checkpoints off" in lines[0]
    assert not NoJustInTime().due(3)


def test_rank_0_announces_the_expected_commit_once_at_the_first_notice():
    clock = Clock()
    notice = Notice(deadline=clock.now + 30.0, node_ids=("n1",))
    announced = []
    jit = JustInTime(
        rank=0,
        group=None,
        margin_seconds=2.0,
        log=lambda line: None,
        read_notice=lambda: notice,
        clock=clock,
        on_notice=lambda n, eta: announced.append((n.node_ids, eta)),
    )
    for step in range(1, 6):
        clock.now += 0.1
        jit.due(step)
    assert announced == [(("n1",), notice.deadline - 2.0)]
    other = []
    JustInTime(
        rank=1,
        group=None,
        margin_seconds=2.0,
        log=lambda line: None,
        read_notice=lambda: notice,
        clock=clock,
        on_notice=lambda n, eta: other.append(eta),
    ).due(1)
    assert other == []  # only rank 0 plans and announces
