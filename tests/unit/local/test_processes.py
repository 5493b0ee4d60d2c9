"""Unit tests for elastic/local/processes.py: stop exactly the processes we marked, nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from elastic.local import processes
from elastic.local.processes import MARKER_VARIABLE, Launched

# A daemon that forks a child (as `ray start --block` forks raylets); both sleep.
_DAEMON = [
    sys.executable,
    "-c",
    "import subprocess,sys,time; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)']); time.sleep(60)",
]


def _wait_for(predicate, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_stop_kills_the_marked_tree_and_spares_an_unrelated_process(tmp_path):
    marker = f"test-{uuid.uuid4().hex}"
    unrelated_env = {k: v for k, v in os.environ.items() if k != MARKER_VARIABLE}
    unrelated = subprocess.Popen(["sleep", "60"], env=unrelated_env)
    launched = None
    try:
        log_path = tmp_path / "logs" / "x.log"
        launched = processes.launch(_DAEMON, role="daemon", marker=marker, env={}, log_path=log_path)
        assert isinstance(launched, Launched)
        assert launched.role == "daemon"
        assert log_path.exists()
        assert launched.process() is not None

        marked = _wait_for(lambda: (lambda found: found if len(found) >= 2 else [])(processes.find_marked(marker)))
        pids = {p.pid for p in marked}
        assert launched.pid in pids, "the launched root carries the marker"
        assert len(pids) == 2, f"expected the daemon and its child, found {pids}"
        child_pid = (pids - {launched.pid}).pop()
        assert psutil.Process(child_pid).ppid() == launched.pid
        assert unrelated.pid not in pids
        assert os.getpid() not in pids

        assert {p.pid for p in processes.stack_processes(marker, [launched])} == pids

        # A short grace: the sleepers die on SIGTERM at once. (psutil.wait_procs also waits for the orphaned
        # child's zombie to be reaped by PID 1, which some container inits do only about once a second.)
        stopped = processes.stop(marker, [launched], grace_seconds=0.3)
        assert stopped == 2

        assert processes.wait_until_gone(marker, [launched], timeout=3.0) == []
        assert processes.find_marked(marker) == []
        assert launched.process() is None or not _alive(launched.pid)
        assert not _alive(child_pid)
        assert unrelated.poll() is None and _alive(unrelated.pid), "an unmarked process was stopped"

        # stopping again is a no-op
        assert processes.stop(marker, [launched], grace_seconds=1.0) == 0
    finally:
        unrelated.kill()
        unrelated.wait(timeout=5)
        # Clean up without trusting the code under test: the root we launched and its descendants, by pid.
        leftovers = []
        if launched is not None:
            root = launched.process()
            if root is not None:
                try:
                    leftovers = [root, *root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    leftovers = []
        for proc in leftovers:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def test_launched_with_a_different_create_time_is_not_that_process():
    me = psutil.Process()
    same = Launched(pid=me.pid, create_time=me.create_time(), role="self")
    assert same.process() is not None and same.process().pid == me.pid

    recycled = Launched(pid=me.pid, create_time=me.create_time() - 100.0, role="self")
    assert recycled.process() is None


def test_launched_survives_a_wall_clock_step():
    """A stepped clock (NTP, a restored VM snapshot) moves every create_time; the start in ticks since boot
    does not, so a live daemon is still recognised, and a different start tick is still a different process."""
    me = psutil.Process()
    ticks = processes.start_ticks(me.pid)
    if ticks is None:
        pytest.skip("no /proc here: identity falls back to create_time")
    stepped = Launched(pid=me.pid, create_time=me.create_time() - 3600.0, role="self", start_ticks=ticks)
    assert stepped.process() is not None
    recycled = Launched(pid=me.pid, create_time=me.create_time(), role="self", start_ticks=ticks + 1)
    assert recycled.process() is None
    assert Launched.from_dict(stepped.to_dict()) == stepped


def test_launched_of_a_dead_pid_is_none():
    proc = subprocess.Popen(["true"])
    create_time = psutil.Process(proc.pid).create_time()
    proc.wait(timeout=10)
    assert Launched(pid=proc.pid, create_time=create_time, role="gone").process() is None


def test_launched_round_trips_through_a_dict():
    launched = Launched(pid=123, create_time=1700000000.5, role="head")
    data = launched.to_dict()
    assert data == {"pid": 123, "create_time": 1700000000.5, "role": "head"}
    assert Launched.from_dict(data) == launched
    assert Launched.from_dict({"pid": "123", "create_time": "1700000000.5", "role": "head"}) == launched


def test_find_marked_ignores_unknown_markers():
    assert processes.find_marked(f"nobody-{uuid.uuid4().hex}") == []


@pytest.mark.parametrize("timeout", [0.0])
def test_wait_until_gone_with_nothing_to_wait_for(timeout):
    assert processes.wait_until_gone(f"nobody-{uuid.uuid4().hex}", [], timeout=timeout) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs root; elsewhere launch leaves it")
def test_a_node_starts_at_raised_priority_and_its_whole_tree_goes_back_to_normal(tmp_path):
    """What a Ray node's processes get: raised priority from the fork on (a child started later inherits it),
    then niceness 0 for the root and every child once the node has joined."""
    marker = uuid.uuid4().hex[:12]
    root = processes.launch(_DAEMON, "node", marker, {}, tmp_path / "node.log", raised_priority=True)
    try:
        proc = root.process()
        assert proc is not None and proc.nice() == processes.STARTUP_NICENESS
        children = _wait_for(lambda: proc.children(recursive=True))
        assert children and all(c.nice() == processes.STARTUP_NICENESS for c in children)
        # With autogroup scheduling the session is what shares the CPU: its niceness is raised too.
        assert processes.session_niceness(proc.pid) in (None, processes.STARTUP_NICENESS)
        processes.normal_priority(root, processes.HEAD_NICENESS)  # what the head keeps: its session's share
        assert [p.nice() for p in (proc, *children)] == [0] * (1 + len(children))
        assert processes.session_niceness(proc.pid) in (None, processes.HEAD_NICENESS)
        processes.normal_priority(root)
        assert [p.nice() for p in (proc, *children)] == [0] * (1 + len(children))
        assert processes.session_niceness(proc.pid) in (None, 0)
    finally:
        processes.kill_trees([root])


def test_a_daemon_launched_without_raised_priority_keeps_its_parents(tmp_path):
    root = processes.launch(_DAEMON, "plain", uuid.uuid4().hex[:12], {}, tmp_path / "plain.log")
    try:
        assert root.process().nice() == os.nice(0)
        processes.normal_priority(root)  # nothing raised: nothing changes
        assert root.process().nice() == os.nice(0)
    finally:
        processes.kill_trees([root])


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs root; elsewhere it is left")
def test_a_session_whose_leader_exited_goes_back_to_normal_through_its_members(tmp_path):
    """A rehearsed node's start command: a shell in a session of its own, raised, runs `ray start`, which
    leaves daemons behind and exits; once the node has joined, the daemons and their session go back."""
    marker = uuid.uuid4().hex[:12]
    env = {**os.environ, MARKER_VARIABLE: marker}
    script = "import subprocess,sys; subprocess.Popen([sys.executable,'-c','import time; time.sleep(60)'])"
    shell = subprocess.Popen([sys.executable, "-c", script], env=env, start_new_session=True)
    processes.raise_priority(shell.pid)
    shell.wait(timeout=30)
    left = _wait_for(lambda: processes.find_marked(marker))
    try:
        assert left and all(p.nice() == processes.STARTUP_NICENESS for p in left)
        assert processes.session_niceness(left[0].pid) in (None, processes.STARTUP_NICENESS)
        processes.sessions_back_to_normal(left, processes.HEAD_NICENESS)
        assert [p.nice() for p in left] == [0] * len(left)
        assert processes.session_niceness(left[0].pid) in (None, processes.HEAD_NICENESS)
    finally:
        for proc in left:
            proc.kill()
