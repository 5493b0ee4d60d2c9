"""`elastic chaos soak`: a job run uninterrupted, then again under N faults drawn from a seed, all at once in one
run: worker kills, kills inside a save, noticed, hard and correlated spot reclaims, S3 error bursts during saves
and during restores, a slow S3 and a killed driver (elastic.diagnostics.soak_plan draws them,
elastic.diagnostics.soak_faults fires them). It needs the local stack with its S3 fault proxy
(`elastic local up --s3-faults`).

The soak passes when every planned fault fired and, from the runs' records:
- at one worker count the final model and optimizer are bit-identical to the uninterrupted run's (across worker
  counts, `--workers 2,1,2`, the per-epoch loss stays within verify-resume's tolerance instead);
- every sample was trained on exactly once per epoch (the sample ledger, elastic.worker.audit);
- no torn checkpoint was ever loaded: every restore's checkpoint had its commit marker before the load began.
It also reports the steps lost to noticed reclaims and the goodput: the uninterrupted run's time (the
productive work) over the faulted run's wall time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from elastic.config.spec import JobSpec
from elastic.diagnostics.soak_faults import FaultedRun, FaultRecord
from elastic.diagnostics.soak_plan import (
    CORRELATED_RECLAIMS,
    DATA_FAULT_KINDS,
    FAULT_KINDS,
    NODE_FAULTS,
    NOTICED,
    goodput,
    lost_steps_after,
    pacing,
    plan_faults,
    verdict,
)
from elastic.diagnostics.verify import Verifier, loss_gap
from elastic.driver import submit
from elastic.errors import UserError
from elastic.local import stack as local
from elastic.local.s3_faults import FaultControl
from elastic.placement.labels import WORKER_ROLE
from elastic.worker.audit import check_exactly_once, torn_loads

NOTICE_SECONDS = 12.0  # a watcher polls, Ray Train polls drains every 5 s, then the just-in-time save
REPLACE_AFTER = 3.0  # seconds until a like node replaces a reclaimed one, as an autoscaler would

PROXY_MISSING = (
    "the chaos soak breaks S3 through the local stack's fault proxy, and this stack has none; restart it with "
    "`elastic local down && elastic local up --s3-faults` (add --spot 2 for correlated reclaims)"
)


@dataclass
class SoakReport:
    faults_planned: int
    faults_fired: int
    identical: bool
    samples_exactly_once: bool
    torn_loaded: int
    lost_steps_noticed: int
    goodput: float
    passed: bool
    problems: list[str]
    seed: int
    workers: list[int]
    faults: list[FaultRecord]
    baseline_run: str
    faulted_run: str
    baseline_seconds: float
    faulted_seconds: float
    restarts: int
    max_abs_diff: float
    loss_within_tolerance: bool
    job_ids: list[str] = field(default_factory=list)
    log: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def streamed_data_path(spec: JobSpec) -> str | None:
    """The key prefix of the dataset a job streams from a bucket (`config.dataset: s3://BUCKET/KEY`), which
    the soak's data-read faults match; None for a job whose data is not in a bucket. A prefix, not a folder: a
    job may read a dataset derived from it (charlm tokenizes `KEY` into `KEY-64-16/`)."""
    dataset = (spec.config or {}).get("dataset")
    if not isinstance(dataset, str) or not dataset.startswith("s3://"):
        return None
    key = dataset[len("s3://") :].partition("/")[2].strip("/")
    return f"/{key}" if key else None


class Soak:
    def __init__(
        self,
        spec: JobSpec,
        target: submit.Target,
        working_dir: Path | None,
        log: TextIO,
        progress: Callable[[str], None],
        stamp: str | None = None,
        notice_seconds: float = NOTICE_SECONDS,
        replace_after: float = REPLACE_AFTER,
    ):
        if target.local is None:
            raise UserError(
                "the chaos soak reclaims nodes and breaks S3 on the local stack only; drop --address and "
                "start one with `elastic local up --s3-faults`"
            )
        if not target.local.s3_upstream:
            raise UserError(PROXY_MISSING)
        self.verifier = Verifier(spec, target, working_dir, log, progress, stamp)  # checks checkpoint.every_steps
        self.spec, self.target, self.working_dir, self.log, self.progress = spec, target, working_dir, log, progress
        self.control = FaultControl(target.local.s3_endpoint)
        self.notice_seconds, self.replace_after = notice_seconds, replace_after
        self.data_path = streamed_data_path(spec)

    def run(self, count: int, seed: int, workers: list[int]) -> SoakReport:
        stamp = self.verifier.stamp
        every = self.spec.checkpoint.every_steps
        # Plan before the long baseline where the plan can be refused without it (too few faults for --workers).
        kinds = DATA_FAULT_KINDS if self.data_path else FAULT_KINDS
        plan_faults(count, seed, (count + 1) * every, every, min(workers), len(workers), kinds)
        baseline = self.verifier.run_segment(f"soak-{stamp}-base", workers[0], [], max_failures=0)
        # Checkpoints and pauses only change when things happen, not what is computed: the faulted run may
        # checkpoint more often and pause after each step and still end bit-identical.
        every, step_seconds = pacing(count, baseline.final_step, every)
        faults = plan_faults(count, seed, baseline.final_step, every, min(workers), len(workers), kinds)
        self._check_capacity(faults)
        self.progress(
            f"faults (checkpoint every {every} steps, {step_seconds:g} s pause per step): "
            + ", ".join(f"{f.kind}@{f.step}" for f in faults)
        )
        spec = self.spec.model_copy(
            update={"checkpoint": self.spec.checkpoint.model_copy(update={"every_steps": every})}
        )
        faulted = FaultedRun(
            spec,
            self.target,
            self.working_dir,
            f"soak-{stamp}-faults",
            self.control,
            self.progress,
            self.notice_seconds,
            self.replace_after,
            step_seconds,
            self.data_path,
        ).run(faults, workers)
        self._write_job_logs(faulted.job_ids)
        return self._report(baseline, faulted, seed, workers, baseline.seconds + step_seconds * baseline.final_step)

    def _check_capacity(self, faults) -> None:
        kinds = {f.kind for f in faults}
        needed = 2 if CORRELATED_RECLAIMS in kinds else 1 if kinds & NODE_FAULTS else 0
        state = local.running_state()
        spot = [n for n in (state.nodes if state else []) if n["role"] == WORKER_ROLE and n["market"] == "spot"]
        if len(spot) < needed:
            raise UserError(
                f"the soak's node faults need {needed} spot nodes, the local stack has {len(spot)}; "
                f"add them with `elastic local add-node --market spot` (or use another --seed)"
            )

    def _write_job_logs(self, job_ids: list[str]) -> None:
        jobs = submit.client(self.target)
        for job_id in job_ids:
            self.log.write(f"\n===== {job_id} (faulted run)\n{jobs.get_job_logs(job_id)}")
        self.log.flush()

    def _report(self, baseline, faulted, seed: int, workers: list[int], productive_seconds: float) -> SoakReport:
        """`productive_seconds`: the uninterrupted run's time with the faulted run's pauses added."""
        records = self.verifier.records
        run = self.spec.run_name(f"soak-{self.verifier.stamp}-faults")
        history = records.history(run)
        once = check_exactly_once(history)
        torn = torn_loads(history)
        final = records.compare_final(baseline.run, run)
        _, within = loss_gap(baseline.epoch_losses, history.epoch_losses())
        fired = sum(1 for f in faulted.faults if f.fired)
        fixed = len(set(workers)) == 1
        problems = verdict(
            fixed,
            final.identical,
            once.ok and baseline.samples_exactly_once,
            torn,
            len(faulted.faults),
            fired,
            within,
        )
        if faulted.status != "SUCCEEDED":
            problems.insert(0, f"the faulted run ended {faulted.status} (see {self.log.name})")
        problems += [f"{run}: {p}" for p in once.problems]
        problems += [f"fault {f.index + 1} ({f.kind}): {f.detail}" for f in faulted.faults if not f.fired]
        noticed_at = [f.fired_at for f in faulted.faults if f.kind in NOTICED and f.fired and f.fired_at]
        return SoakReport(
            faults_planned=len(faulted.faults),
            faults_fired=fired,
            identical=final.identical,
            samples_exactly_once=once.ok and baseline.samples_exactly_once,
            torn_loaded=len(torn),
            lost_steps_noticed=lost_steps_after(noticed_at, history.attempts, history.last_step, history.resumed_from),
            goodput=goodput(productive_seconds, faulted.seconds),
            passed=not problems,
            problems=problems,
            seed=seed,
            workers=list(workers),
            faults=faulted.faults,
            baseline_run=baseline.run,
            faulted_run=run,
            baseline_seconds=baseline.seconds,
            faulted_seconds=faulted.seconds,
            restarts=max(0, len(history.attempts) - 1),
            max_abs_diff=final.max_abs_diff,
            loss_within_tolerance=within,
            job_ids=faulted.job_ids,
            log=self.log.name,
        )


def default_log_path(stamp: str) -> Path:
    folder = local.home_dir() / "soak"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"soak-{stamp}.log"
