"""`elastic bench recovery`: what a spot reclaim costs, ours against Ray Train's own restart, on the local cluster.

Side by side in one run, the same model, data, worker count and checkpoint interval:

(a) noticed: `elastic preempt --notice S` of a node holding one of our workers: steps lost (computed but absent
    from the resumed state), seconds from node death to the first resumed step, and the idle seconds between
    our just-in-time commit and the node's death;
(b) hard: the same without notice: steps lost (back to the last periodic checkpoint);
(c) bare Ray: a plain Ray Train loop with Ray's own checkpointing, reclaimed with the same notice (Ray Train
    restarts it when the drain deadline passes): seconds from node death to its first resumed step;
(d) goodput (optional, --minutes): a run with a noticed reclaim every --every seconds: time in steps that count
    over wall time from the first step to the last.

Each reclaim kills a node holding a worker of the run; a spare spot node lets the run resume at once at its
fixed worker count, and a like node replaces the reclaimed one (as an autoscaler would) once the run has
resumed. On a cloud the replacement boots on other hardware; here a node's boot takes both cores for about 10
s, and started at the kill it would be charged to the resumed run's restart (it was seen stretching Ray's
worker-group start from 9 s to 13 s). A real autoscaler takes minutes, so waiting for the resume is not
generous. Timelines come from elastic.bench.jobs.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.bench.jobs import read_timeline
from elastic.checkpoint.store import CheckpointStore
from elastic.config.spec import JobSpec
from elastic.driver import submit
from elastic.errors import ClusterError
from elastic.local import preempt
from elastic.local import stack as local

WIDTH, BATCH, EVERY_STEPS = 1024, 256, 50  # ~30-60 ms steps on one CPU core: a realistic step, not a no-op


@dataclass
class RecoveryBench:
    notice_seconds: float
    checkpoint_every_steps: int
    workers: int
    step_ms: float
    lost_steps_notice: int
    notice_idle_s: float
    recovery_s: float
    lost_steps_hard: int
    hard_recovery_s: float
    bare_ray_recovery_s: float
    bare_ray_lost_steps: int
    recovery_ratio: float
    goodput: float | None
    goodput_minutes: float | None
    goodput_preemptions: int | None
    goodput_gaps_s: list[float] | None  # per reclaim: last step before it to the first step after it


@dataclass
class Outcome:
    lost_steps: int
    recovery_s: float  # node death -> first step of the next attempt
    resumed_step: int
    killed_at: float
    step_seconds: float
    idle: float | None = None  # node death - just-in-time commit (noticed reclaims of our run)


class _Run:
    """One benchmark run on the local stack: ours (`elastic submit`) or the bare Ray loop (a Ray job)."""

    def __init__(self, state: local.LocalState, kind: str, steps: int, workers: int, root: Path):
        self.state, self.kind, self.steps, self.workers = state, kind, steps, workers
        self.name = f"bench-recovery-{kind}-{time.strftime('%H%M%S')}"
        self.timeline = str(root / self.name)
        self.job_id: str | None = None

    def start(self) -> None:
        target = submit.Target(self.state.dashboard_url, self.state)
        if self.kind == "bare":
            uri = f"s3://{self.state.bucket}/bench"
            self.job_id = f"{self.name}-job"
            submit.client(target).submit_job(
                entrypoint=f"{sys.executable} -m elastic.bench.jobs {self.name} {self.timeline} {self.steps} "
                f"{WIDTH} {BATCH} {EVERY_STEPS} {uri} {self.workers}",
                submission_id=self.job_id,
                entrypoint_label_selector=submit.driver_placement(target),
            )
            return
        spec = JobSpec.model_validate(
            {
                "name": self.name,
                "entrypoint": "elastic.bench.jobs:harness_train",
                "config": {"width": WIDTH, "batch": BATCH, "steps": self.steps, "timeline": self.timeline},
                "workers": {"min": self.workers, "cpus": 1, "market": "spot"},
                "checkpoint": {"uri": f"s3://{self.state.bucket}/bench", "every_steps": EVERY_STEPS, "keep": 2},
                "failure": {"max_failures": -1, "max_preemptions": -1},
            }
        )
        self.job_id = submit.submit(spec, target, working_dir=Path(__file__).resolve().parents[1]).job_id

    def attempts(self) -> list[dict]:
        return read_timeline(self.timeline) if Path(self.timeline).exists() else []

    def wait_for_step(self, step: int, after_attempts: int = 0, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            attempts = self.attempts()
            if len(attempts) > after_attempts and attempts[-1]["steps"] and attempts[-1]["steps"][-1][0] >= step:
                return attempts[-1]
            self._check_alive()
            time.sleep(0.5)
        raise ClusterError(f"bench recovery: {self.name} did not reach step {step} within {timeout:.0f} s")

    def stop(self) -> None:
        try:
            submit.client(submit.Target(self.state.dashboard_url, self.state)).stop_job(self.job_id)
        except Exception:  # already ended
            pass

    def worker_node(self) -> dict:
        """A spot node holding one of this run's workers (the latest attempt's), not rank 0's if it can help."""
        attempt = self.attempts()[-1]
        nodes = {n["node_id"]: n for n in local.running_state().nodes}
        candidates = [nodes[n] for n in attempt["nodes"] if n in nodes and nodes[n]["market"] == "spot"]
        if not candidates:
            raise ClusterError("bench recovery: no spot node holds a worker of the run")
        others = [c for c in candidates if c["node_id"] != attempt["node"]]
        return (others or candidates)[0]

    def _check_alive(self) -> None:
        info = submit.client(submit.Target(self.state.dashboard_url, self.state)).get_job_info(self.job_id)
        if str(info.status) in ("FAILED", "STOPPED"):
            raise ClusterError(f"bench recovery: job {self.job_id} ended {info.status}: {info.message}")


def _reclaim(run: _Run, notice: float | None, log) -> Outcome:
    """Reclaim a node of the run, measure the recovery, then start a replacement (see the module's note)."""
    before = run.attempts()
    node = run.worker_node()
    log(f"  reclaiming {node['name']} ({'hard' if notice is None else f'{notice:g} s notice'})")
    report = preempt.preempt([node], notice=notice, hard=notice is None, replace_after=None, log=lambda _: None)
    killed_at = report.reclaims[0].killed_at
    resumed = _first_step(run, len(before))
    idle = None
    if notice is not None and run.kind == "ours":  # read now: retention prunes it a few saves later
        committed = _commit_time(run.state, run, resumed["start"])
        idle = round(killed_at - committed, 2) if committed else float("nan")
    local.add_node(node["market"])
    old = run.attempts()[len(before) - 1]
    steps = [t for s, t in old["steps"]]
    step_seconds = statistics.median(b - a for a, b in zip(steps, steps[1:])) if len(steps) > 2 else 0.0
    lost = max(s for s, _ in old["steps"]) - resumed["start"]
    return Outcome(
        lost_steps=max(0, lost),
        recovery_s=round(resumed["steps"][0][1] - killed_at, 2),
        resumed_step=resumed["start"],
        killed_at=killed_at,
        step_seconds=step_seconds,
        idle=idle,
    )


def _first_step(run: _Run, attempts_before: int, timeout: float = 600) -> dict:
    """The first attempt after `attempts_before` that took a step (an attempt may die before its first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stepped = [a for a in run.attempts()[attempts_before:] if a["steps"]]
        if stepped:
            return stepped[0]
        time.sleep(0.25)
    raise ClusterError(f"bench recovery: {run.name} did not resume within {timeout:.0f} s")


def _commit_time(state: local.LocalState, run: _Run, step: int) -> float | None:
    with state.environment():
        info = CheckpointStore(f"s3://{state.bucket}/bench/{run.name}").info(step)
    return info.time if info.committed else None


def _goodput(run: _Run) -> tuple[float, int, list[float]]:
    """Time in steps that count over wall time. A step counts unless a later attempt resumed from before it;
    a step's time is the gap since the previous step of its attempt (an attempt's first step is charged the
    attempt's median step, not its start-up). Wall time runs from the first step to the last."""
    attempts = run.attempts()
    counted = 0.0
    for index, attempt in enumerate(attempts):
        steps = attempt["steps"]
        if not steps:
            continue
        limit = attempts[index + 1]["start"] if index + 1 < len(attempts) else float("inf")
        gaps = [b[1] - a[1] for a, b in zip(steps, steps[1:])]
        typical = statistics.median(gaps) if gaps else 0.0
        counted += sum(gap for (step, _), gap in zip(steps, [typical, *gaps]) if step <= limit)
    first = min(a["steps"][0][1] for a in attempts if a["steps"])
    last = max(a["steps"][-1][1] for a in attempts if a["steps"])
    stepped = [a for a in attempts if a["steps"]]
    gaps = [round(b["steps"][0][1] - a["steps"][-1][1], 1) for a, b in zip(stepped, stepped[1:])]
    return counted / (last - first), len(attempts) - 1, gaps


def bench_recovery(
    notice: float = 20.0, workers: int = 2, minutes: float | None = None, every: float = 120.0, log=print
) -> RecoveryBench:
    state = local.running_state()
    if state is None:
        raise ClusterError("bench recovery runs on the local stack; start it with `elastic local up --spot 3`")
    spot = [n for n in state.nodes if n["market"] == "spot"]
    for _ in range(workers + 1 - len(spot)):  # the run's nodes plus a spare
        log(f"  adding a spot node ({local.add_node('spot')['name']})")
    root = Path(tempfile.mkdtemp(prefix="elastic-bench-recovery-"))
    steps = 10**7
    try:
        results = {}
        for kind, notice_for in (("notice", notice), ("hard", None), ("bare", notice)):
            run = _Run(local.running_state(), "bare" if kind == "bare" else "ours", steps, workers, root)
            log(f"{kind}: {run.name}")
            run.start()
            try:
                run.wait_for_step(2 * EVERY_STEPS + EVERY_STEPS // 2)
                outcome = _reclaim(run, notice_for, log)
                run.wait_for_step(outcome.resumed_step + 10, after_attempts=0)
                results[kind] = outcome
                log(
                    f"  lost {outcome.lost_steps} steps, first resumed step {outcome.recovery_s:.1f} s after "
                    "the node died"
                )
            finally:
                run.stop()
        good = preemptions = gaps = None
        if minutes:
            run = _Run(local.running_state(), "ours", steps, workers, root)
            log(f"goodput: {run.name}, {minutes:g} min, a {notice:g} s notice every {every:g} s")
            run.start()
            try:
                run.wait_for_step(1)
                ends = time.monotonic() + minutes * 60
                while time.monotonic() + every < ends:
                    time.sleep(every - notice)
                    _reclaim(run, notice, log)
                time.sleep(max(0.0, ends - time.monotonic()))
                good, preemptions, gaps = _goodput(run)
            finally:
                run.stop()
        notice_run, hard, bare = results["notice"], results["hard"], results["bare"]
        return RecoveryBench(
            notice_seconds=notice,
            checkpoint_every_steps=EVERY_STEPS,
            workers=workers,
            step_ms=round(notice_run.step_seconds * 1000, 2),
            lost_steps_notice=notice_run.lost_steps,
            notice_idle_s=notice_run.idle,
            recovery_s=notice_run.recovery_s,
            lost_steps_hard=hard.lost_steps,
            hard_recovery_s=hard.recovery_s,
            bare_ray_recovery_s=bare.recovery_s,
            bare_ray_lost_steps=bare.lost_steps,
            recovery_ratio=round(notice_run.recovery_s / bare.recovery_s, 3) if bare.recovery_s > 0 else float("nan"),
            goodput=round(good, 4) if good is not None else None,
            goodput_minutes=minutes,
            goodput_preemptions=preemptions,
            goodput_gaps_s=gaps,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
