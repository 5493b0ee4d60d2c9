"""`elastic verify-resume`: prove that a job resumes exactly, on the cluster it will run on.

The job runs twice with a sample ledger on (elastic.worker.audit): once uninterrupted, once with K injected worker
kills, some of them inside a checkpoint save (the checkpoint is torn; the restart must fall back to the one
before), and N reclaim notices (`--notices`: the run ends its placement at a just-in-time checkpoint and the
driver resumes it from there). With `--workers 2,1,2` the interrupted run also changes its worker count: a kill that exhausts the
failure budget ends a segment, and the run is resubmitted at the next count, resuming resharded.

It then compares: at a fixed worker count the final model and optimizer must be bit-identical to the
uninterrupted run's; at any worker counts every sample of every epoch must have been trained on exactly
once, and across a worker-count change the per-epoch loss must stay within a stated tolerance of the
uninterrupted run's (the global batch changes with the worker count, so the trajectories legitimately differ).
At a fixed worker count the report also names the first step whose loss left the baseline's, and the checkpoint
the run had resumed from before it: where to look for state that a checkpoint does not carry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO

from elastic.config.spec import JobSpec
from elastic.diagnostics.records import RunRecords, audited_spec, samples
from elastic.driver import submit
from elastic.driver.runs import read_summary
from elastic.errors import SpecError, UserError, VerifyFailed
from elastic.local.stack import home_dir
from elastic.worker.audit import Divergence, check_exactly_once, first_divergence
from elastic.worker.chaos import Kill, format_plan

# Across a worker-count change: |loss - baseline| <= REL * |baseline| + ABS for every epoch's mean loss. Loose
# on purpose: fewer workers take more (smaller) optimizer steps per epoch and legitimately learn faster per
# epoch (digits, 2 -> 1 -> 2 workers: epoch 1 at 0.22 against 0.44); what this catches is divergence, as
# from a wrongly restored optimizer or learning-rate schedule, not a different but healthy trajectory.
LOSS_REL_TOLERANCE = 0.5
LOSS_ABS_TOLERANCE = 0.05


# ---------------------------------------------------------------------------------------------------------
# Planning (pure)


@dataclass(frozen=True)
class KillPoint:
    """A fault placed at a fraction of the run's samples: a kill (`ends_segment` kills switch the worker count)
    or a reclaim notice."""

    index: int
    fraction: float
    during_save: bool
    ends_segment: bool
    notice: bool = False


def kill_points(kills: int, segments: int, notices: int = 0) -> list[KillPoint]:
    """K kills and N notices spread evenly over the run, in that order (each notice lands between two kills
    when there are enough of them); every other kill inside a checkpoint save; `segments - 1` kills (spread
    evenly too) end a segment so the next one starts at another worker count."""
    if kills < segments - 1:
        raise UserError(
            f"--kills {kills} is too few for {segments} worker counts; "
            f"use --kills {segments - 1} or more (each change of worker count is a kill)"
        )
    ends = {round((j + 1) * kills / segments) - 1 for j in range(segments - 1)}
    total = kills + notices
    # Notices take evenly spaced slots among all the points; kills fill the rest in order.
    notice_slots = {round((j + 1) * total / (notices + 1)) - 1 for j in range(notices)} if notices else set()
    points, kill_index = [], 0
    for slot in range(total):
        fraction = (slot + 1) / (total + 1)
        if slot in notice_slots:
            points.append(KillPoint(slot, fraction, during_save=False, ends_segment=False, notice=True))
        else:
            points.append(KillPoint(slot, fraction, during_save=kill_index % 2 == 1, ends_segment=kill_index in ends))
            kill_index += 1
    return points


def kill_step(
    point: KillPoint, resumed_step: int, consumed: float, total: float, per_step: float, every_steps: int
) -> int:
    """The global step at which `point` fires in a segment that resumed at `resumed_step` having consumed
    `consumed` of `total` samples, taking `per_step` samples a step. Saves happen at multiples of every_steps."""
    step = resumed_step + max(1, math.ceil((point.fraction * total - consumed) / per_step))
    if point.during_save:
        step = math.ceil(step / every_steps) * every_steps
    return step


# ---------------------------------------------------------------------------------------------------------
# Report


@dataclass
class RunReport:
    run: str
    status: str
    final_step: int
    workers: list[int]
    restarts: int
    kill_plan: list[str]
    epoch_losses: dict[int, float]
    samples_exactly_once: bool | None  # None: not audited (an api whose data loading is its own)
    problems: list[str]
    seconds: float
    just_in_time_ends: int = 0  # placements that ended at a just-in-time checkpoint (the run summary says)


@dataclass
class VerifyReport:
    identical: bool
    max_abs_diff: float
    samples_exactly_once: bool | None  # None: not audited (an api whose data loading is its own)
    kills: int
    kills_fired: int
    notices: int
    notices_fired: int
    workers: list[int]
    loss_within_tolerance: bool
    loss_tolerance: str
    max_epoch_loss_diff: float
    passed: bool
    problems: list[str]
    baseline: RunReport
    interrupted: RunReport
    log: str = ""
    tensors_compared: int = 0
    criteria: str = field(default="")
    # At a fixed worker count: the first step whose loss differs from the baseline's (None: none does).
    first_loss_divergence: Divergence | None = None

    def to_json(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------
# Running


class Verifier:
    """Runs the two versions of a job through Ray's job API and compares them."""

    def __init__(
        self,
        spec: JobSpec,
        target,
        working_dir: Path | None,
        log: TextIO,
        progress: Callable[[str], None],
        stamp: str | None = None,
    ):
        if spec.checkpoint.every_steps is None:
            raise SpecError(
                "verify-resume places kills around checkpoints by step: set checkpoint.every_steps "
                "(e.g. --set checkpoint.every_steps=20)"
            )
        self.spec = spec
        self.target = target
        self.working_dir = working_dir
        self.log = log
        self.progress = progress
        self.stamp = stamp or time.strftime("%m%d%H%M%S")
        self.records = RunRecords(spec)
        # Session jobs keep a sample ledger (session.loader); the other apis load their own data, so their
        # check is the final state alone (bit-identical at a fixed worker count).
        self.audited = spec.api == "session"

    def run(self, kills: int, workers: list[int], notices: int = 0) -> VerifyReport:
        if not self.audited and len(set(workers)) > 1:
            raise SpecError(
                f"verify-resume --workers with changing counts checks exactly-once through session.loader; an "
                f"api {self.spec.api} job loads its own data: verify it at one worker count"
            )
        points = kill_points(kills, len(workers), notices)
        base_suffix, kill_suffix = f"verify-{self.stamp}-base", f"verify-{self.stamp}-kills"
        baseline = self.run_segment(base_suffix, workers[0], [], max_failures=0)
        base_history = self.records.history(baseline.run)
        if self.audited:
            total = samples(base_history, base_history.final_step)
            per_rank_step = total / max(1, base_history.final_step * workers[0])
        else:  # no sample ledger: kills are planned in steps (one step a unit of progress)
            total = self.records.latest_step(baseline.run)
            per_rank_step = 1.0 / workers[0]

        interrupted: RunReport | None = None
        plan_text: list[str] = []
        started = time.monotonic()
        remaining = list(points)
        just_in_time_ends = 0
        for index, count in enumerate(workers):
            mine = []
            while remaining:
                mine.append(remaining.pop(0))
                if mine[-1].ends_segment:
                    break
            resumed = self.records.latest_step(self.spec.run_name(kill_suffix))
            consumed = samples(self.records.history(self.spec.run_name(kill_suffix)), resumed) if resumed else 0
            if not self.audited:
                consumed = resumed
            plan = [
                Kill(
                    kill_step(p, resumed, consumed, total, per_rank_step * count, self.spec.checkpoint.every_steps),
                    0 if p.notice else p.index % count,
                    p.during_save,
                    p.notice,
                )
                for p in mine
            ]
            expected_end = resumed + math.ceil((total - consumed) / (per_rank_step * count))
            _check_plan(plan, resumed, expected_end)
            plan_text += [str(k) for k in plan]
            last = index == len(workers) - 1
            # A segment that must end at its last kill gets one failure fewer than it has kills (notices are
            # preemptions, not failures).
            killing = sum(1 for k in plan if not k.notice)
            budget = killing if last else killing - 1
            interrupted = self.run_segment(kill_suffix, count, plan, max_failures=budget, expect_failure=not last)
            just_in_time_ends += interrupted.just_in_time_ends  # each segment's summary covers that segment
        assert interrupted is not None
        interrupted.just_in_time_ends = just_in_time_ends
        interrupted.seconds = round(time.monotonic() - started, 1)
        interrupted.kill_plan = plan_text
        interrupted.workers = list(workers)
        return self._compare(baseline, interrupted, kills, notices, workers)

    # -- one submission
    def run_segment(
        self, suffix: str, workers: int, plan: list[Kill], max_failures: int, expect_failure: bool = False
    ) -> RunReport:
        """Submit the audited job with the in-worker faults of `plan`, follow it to its end, and report."""
        spec = audited_spec(self.spec, workers, plan, max_failures)
        what = f"{workers} workers" + (f", kills at {format_plan(plan)}" if plan else ", uninterrupted")
        self.progress(f"run {spec.run_name(suffix)}: {what}")
        started = time.monotonic()
        submitted = submit.submit(spec, self.target, suffix=suffix, working_dir=self.working_dir, check_bucket=False)
        self.log.write(f"\n===== {submitted.job_id}: {what}\n")
        status = submit.follow(self.target, submitted.job_id, out=self.log)
        self.log.flush()
        seconds = round(time.monotonic() - started, 1)
        if status != ("FAILED" if expect_failure else "SUCCEEDED"):
            raise VerifyFailed(
                f"job {submitted.job_id} ended {status}, expected "
                f"{'FAILED (a worker-count switch)' if expect_failure else 'SUCCEEDED'}; "
                f"see {self.log.name}"
            )
        self.progress(f"run {spec.run_name(suffix)}: {status.lower()} after {seconds} s")
        history = self.records.history(spec.run_name(suffix))
        check = check_exactly_once(history) if self.audited else None
        summary = read_summary(spec, spec.run_name(suffix)) or {}
        ends = sum(1 for p in summary.get("placements", []) if p.get("ended_by") == "preemption")
        return RunReport(
            run=spec.run_name(suffix),
            status=status,
            final_step=history.final_step if self.audited else self.records.latest_step(spec.run_name(suffix)),
            workers=[workers],
            restarts=max(0, len(history.attempts) - 1),
            kill_plan=[],
            epoch_losses=history.epoch_losses(),
            samples_exactly_once=check.ok if check else None,
            problems=check.problems if check else [],
            seconds=seconds,
            just_in_time_ends=ends,
        )

    # -- comparison
    def _compare(
        self, baseline: RunReport, interrupted: RunReport, kills: int, notices: int, workers: list[int]
    ) -> VerifyReport:
        final = self.records.compare_final(baseline.run, interrupted.run)
        identical, max_abs_diff = final.identical, final.max_abs_diff
        problems: list[str] = []
        fired = len(self.records.fired(interrupted.run, "kill"))
        if fired != kills:
            problems.append(f"{fired} of {kills} planned kills fired")
        notices_fired = len(self.records.fired(interrupted.run, "notice"))
        if notices_fired != notices:
            problems.append(f"{notices_fired} of {notices} planned reclaim notices fired")
        elif interrupted.just_in_time_ends < notices:
            problems.append(
                f"{notices} reclaim notices fired but {interrupted.just_in_time_ends} placements ended at "
                "a just-in-time checkpoint (is checkpoint.just_in_time off?)"
            )
        fixed = len(set(workers)) == 1
        # The per-step loss is the session's own; a Trainer logs a mean over its logging window, which a resume
        # mid-window shortens, so other apis are judged by their final state alone.
        divergence = (
            first_divergence(self.records.history(baseline.run), self.records.history(interrupted.run))
            if fixed and self.audited
            else None
        )
        if fixed and not identical:
            problems.append(
                f"final state differs from the uninterrupted run's in {len(final.changed) or 'all'} "
                f"tensors (e.g. {', '.join(final.changed[:3])}), max |diff| {max_abs_diff:.3g}"
            )
        if divergence is not None:
            problems.append(f"the loss first left the baseline's at {divergence}")
        diff, within = loss_gap(baseline.epoch_losses, interrupted.epoch_losses)
        if not fixed and not within:
            problems.append(f"per-epoch loss moved by up to {diff:.3g}, beyond the tolerance")
        for report in (baseline, interrupted):
            problems += [f"{report.run}: {p}" for p in report.problems]
        exactly_once = baseline.samples_exactly_once and interrupted.samples_exactly_once if self.audited else None
        return VerifyReport(
            identical=identical,
            max_abs_diff=max_abs_diff,
            samples_exactly_once=exactly_once,
            kills=kills,
            kills_fired=fired,
            notices=notices,
            notices_fired=notices_fired,
            workers=list(workers),
            loss_within_tolerance=within,
            loss_tolerance=f"|loss - baseline| <= {LOSS_REL_TOLERANCE} * |baseline| + {LOSS_ABS_TOLERANCE} per epoch",
            max_epoch_loss_diff=diff,
            passed=not problems,
            problems=problems,
            baseline=baseline,
            interrupted=interrupted,
            log=self.log.name,
            tensors_compared=final.compared,
            first_loss_divergence=divergence,
            criteria=(
                f"bit-identical final model and optimizer (api {self.spec.api}: its data loading is its own, "
                "so samples are not audited)"
                if not self.audited
                else "bit-identical final model and optimizer, every sample once per epoch"
                if fixed
                else "every sample once per epoch, per-epoch loss within tolerance"
            ),
        )


def _check_plan(plan: list[Kill], resumed: int, end: int) -> None:
    steps = [k.step for k in plan]
    if steps != sorted(set(steps)) or (steps and (steps[0] <= resumed or steps[-1] >= end)):
        raise UserError(
            f"the job is too short for these kills (planned at steps {steps} after a resume at "
            f"{resumed}, the run ends near step {end}); train longer (e.g. more epochs) or use fewer --kills"
        )


def loss_gap(base: dict[int, float], other: dict[int, float]) -> tuple[float, bool]:
    epochs = [e for e in base if e in other]
    if not epochs:
        return float("inf"), False
    gaps = [abs(other[e] - base[e]) for e in epochs]
    within = all(abs(other[e] - base[e]) <= LOSS_REL_TOLERANCE * abs(base[e]) + LOSS_ABS_TOLERANCE for e in epochs)
    return max(gaps), within and len(epochs) == len(base)


def default_log_path(stamp: str) -> Path:
    folder = home_dir() / "verify"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"verify-{stamp}.log"


def storage_environment(target) -> None:
    """Read the runs' ledgers and checkpoints with the local stack's endpoint when that is the target."""
    if target.local is not None:
        target.local.use_storage()
