"""Unit tests for elastic/worker/watchdog.py: the timeout it derives, and that a rank with no step progress for
the timeout is ended (stacks dumped and kept, the attempt's end recorded) while a progressing or paused one is
not. A fake clock and a fake exit; the dump is faulthandler's real one."""

from __future__ import annotations

import threading

import pytest

from elastic.worker.watchdog import EXIT_CODE, FLOOR_SECONDS, HangTimeout, HangWatchdog, dump_stacks


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_derived_timeout_has_a_floor_and_grows_with_the_slowest_step_and_save():
    timeout = HangTimeout(None)
    assert timeout.seconds() == FLOOR_SECONDS
    timeout.stepped(0.05)
    timeout.saved(2.0)
    assert timeout.seconds() == FLOOR_SECONDS  # 20 x 0.05 + 3 x 2 is far below the floor
    timeout.stepped(30.0)  # a large model's step
    timeout.saved(40.0)
    assert timeout.seconds() == pytest.approx(20 * 30.0 + 3 * 40.0)
    timeout.stepped(1.0)  # the slowest seen is kept
    assert timeout.seconds() == pytest.approx(720.0)
    assert "slowest step 30.00 s" in timeout.describe()


def test_a_configured_timeout_is_used_as_given_and_zero_turns_it_off():
    assert HangTimeout(15.0).seconds() == 15.0
    assert HangTimeout(0.0).seconds() is None


def _watchdog(clock, timeout=10.0):
    seen = {"exit": [], "stacks": [], "ended": []}
    dog = HangWatchdog(
        1,
        HangTimeout(timeout),
        on_hang=seen["ended"].append,
        write=seen["stacks"].append,
        grace_seconds=0.0,
        clock=clock,
        exit=seen["exit"].append,
        poll_seconds=3600,  # the test calls check() itself
    )
    return dog, seen


def test_no_step_for_the_timeout_dumps_the_stacks_records_the_end_and_exits():
    clock = Clock()
    dog, seen = _watchdog(clock)
    assert not dog.check()  # not armed before the first step
    dog.progress(1)
    clock.now += 5
    dog.progress(2)
    clock.now += 9.9
    assert not dog.check()
    clock.now += 0.2
    assert dog.check()
    assert seen["exit"] == [EXIT_CODE]
    assert seen["ended"] == [2]  # the last step the rank finished
    assert "test_no_step_for_the_timeout" in seen["stacks"][0]  # this very thread's frame is in the dump
    assert not dog.check()  # fires once
    dog.stop()


def test_steps_keep_it_quiet_and_a_pause_disarms_it_until_the_next_step():
    clock = Clock()
    dog, seen = _watchdog(clock)
    for step in range(1, 50):
        clock.now += 1.0
        dog.progress(step)
        assert not dog.check()
    dog.pause()  # e.g. waiting for Ray Train's restart after a just-in-time checkpoint
    clock.now += 1000
    assert not dog.check()
    dog.progress(50)
    clock.now += 11
    assert dog.check() and seen["exit"] == [EXIT_CODE]
    dog.stop()


def test_a_failing_or_stuck_bookkeeping_call_does_not_hold_the_exit_up():
    clock = Clock()
    stuck = threading.Event()
    exits = []
    dog = HangWatchdog(
        0,
        HangTimeout(1.0),
        on_hang=lambda step: stuck.wait(),  # a storage call that never returns
        write=lambda stacks: 1 / 0,
        grace_seconds=0.2,
        clock=clock,
        exit=exits.append,
        poll_seconds=3600,
    )
    dog.progress(1)
    clock.now += 2
    assert dog.check() and exits == [EXIT_CODE]
    stuck.set()
    dog.stop()


def test_the_dump_holds_every_threads_stack():
    ready, release = threading.Event(), threading.Event()

    def parked_in_a_collective() -> None:
        ready.set()
        release.wait()

    thread = threading.Thread(target=parked_in_a_collective)
    thread.start()
    ready.wait()
    try:
        stacks = dump_stacks()
    finally:
        release.set()
        thread.join()
    assert "parked_in_a_collective" in stacks and "test_the_dump_holds_every_threads_stack" in stacks
