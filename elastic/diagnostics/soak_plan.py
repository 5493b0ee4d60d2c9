"""The pure parts of `elastic chaos soak`: which faults a seed draws and where they land, goodput, the loss of
noticed reclaims, and the verdict. No Ray, no I/O: unit-tested on their own (elastic.diagnostics.soak runs them).

Faults land at evenly spaced fractions of the uninterrupted run's steps. Two of them fire inside the workers
(through elastic.worker.chaos, at an exact step); the soak fires the others from outside, once the run's
committed checkpoints have reached their step.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from elastic.errors import UserError

WORKER_KILL = "worker_kill"  # a training worker dies (os._exit, like a SIGKILL) after a step
SAVE_KILL = "save_kill"  # a worker dies inside a checkpoint save: that checkpoint is torn
NOTICED_RECLAIM = "noticed_reclaim"  # a spot node reclaimed with notice (metadata -> watcher -> drain)
HARD_NODE_LOSS = "hard_node_loss"  # a node killed without notice
CORRELATED_RECLAIMS = "correlated_reclaims"  # two spot nodes reclaimed at the same moment, with notice
S3_SAVE_ERRORS = "s3_save_errors"  # a burst of 503 SlowDown on the checkpoint's uploads
S3_RESTORE_ERRORS = "s3_restore_errors"  # a burst of 500s on the checkpoint's reads while the run restores
SLOW_S3 = "slow_s3"  # every S3 request delayed until the next checkpoint commits
DRIVER_KILLED = "driver_killed"  # the job's driver stopped, and the job resubmitted (resumes from storage)
# 503s and reset connections on the training data's reads, met as the run restarts (a worker killed) and
# reads its data window again: the reads are retried, no sample lost or repeated.
S3_DATA_READ_ERRORS = "s3_data_read_errors"

FAULT_KINDS = (
    WORKER_KILL,
    SAVE_KILL,
    NOTICED_RECLAIM,
    HARD_NODE_LOSS,
    CORRELATED_RECLAIMS,
    S3_SAVE_ERRORS,
    S3_RESTORE_ERRORS,
    SLOW_S3,
    DRIVER_KILLED,
)
IN_WORKER = frozenset({WORKER_KILL, SAVE_KILL})
NODE_FAULTS = frozenset({NOTICED_RECLAIM, HARD_NODE_LOSS, CORRELATED_RECLAIMS})
# Faults after which the run starts a new attempt (restores from storage); the others leave it running.
RESTARTS = frozenset({WORKER_KILL, SAVE_KILL, *NODE_FAULTS, S3_RESTORE_ERRORS, S3_DATA_READ_ERRORS, DRIVER_KILLED})
NOTICED = frozenset({NOTICED_RECLAIM, CORRELATED_RECLAIMS})
# Jobs that stream their data from the bucket (config.dataset) also draw faults on its reads.
DATA_FAULT_KINDS = (*FAULT_KINDS, S3_DATA_READ_ERRORS)
# Training time to give each fault: a reclaim's notice, the drain, a just-in-time save and a restart must fit
# before the run ends, or the fault never meets it.
SECONDS_PER_FAULT = 20.0


@dataclass(frozen=True)
class Fault:
    index: int
    kind: str
    step: int  # in-worker faults fire at this step; the others once a checkpoint at or after it committed
    rank: int = 0  # in-worker faults: the rank that dies

    @property
    def in_worker(self) -> bool:
        return self.kind in IN_WORKER


def draw_kinds(count: int, seed: int, segments: int = 1, kinds_drawn: tuple[str, ...] = FAULT_KINDS) -> list[str]:
    """`count` fault kinds of `kinds_drawn` from `seed`: every kind once, in a seeded order, before any repeats
    (so 9 faults or more cover the default kinds). A run that changes its worker count `segments - 1` times needs as many driver
    kills (each resubmission moves to the next count): the last other draws give way to them."""
    if count < segments - 1:
        raise UserError(
            f"--faults {count} is too few for {segments} worker counts; use --faults {segments - 1} or more "
            "(each change of worker count is a resubmission after a driver kill)"
        )
    rng = random.Random(seed)
    kinds: list[str] = []
    while len(kinds) < count:
        cycle = list(kinds_drawn)
        rng.shuffle(cycle)
        kinds += cycle
    kinds = kinds[:count]
    missing = segments - 1 - kinds.count(DRIVER_KILLED)
    for position in reversed(range(count)):
        if missing <= 0:
            break
        if kinds[position] != DRIVER_KILLED:
            kinds[position] = DRIVER_KILLED
            missing -= 1
    return kinds


def plan_faults(
    count: int,
    seed: int,
    final_step: int,
    every_steps: int,
    workers: int,
    segments: int = 1,
    kinds_drawn: tuple[str, ...] = FAULT_KINDS,
) -> list[Fault]:
    """The soak's faults over a run of about `final_step` steps that checkpoints every `every_steps`: the i-th
    of N lands at step (i+1)/(N+1) of the run; a save kill on the next checkpoint's step. Each fault needs a
    checkpoint between it and the next, so the run must be long enough: a UserError says how long."""
    kinds = draw_kinds(count, seed, segments, kinds_drawn)
    needed = (count + 1) * every_steps
    if final_step < needed:
        raise UserError(
            f"the job is too short for {count} faults: it takes {final_step} steps, the soak needs at least "
            f"{needed} (a checkpoint, every {every_steps} steps, between faults); train longer (more epochs) "
            "or use fewer --faults"
        )
    faults, taken = [], set()
    for index, kind in enumerate(kinds):
        step = max(1, round((index + 1) * final_step / (count + 1)))
        if kind == SAVE_KILL:
            step = math.ceil(step / every_steps) * every_steps
        while kind in IN_WORKER and step in taken:  # one in-worker fault per step
            step += every_steps if kind == SAVE_KILL else 1
        if kind in IN_WORKER:
            taken.add(step)
        faults.append(Fault(index, kind, step, rank=index % workers if kind in IN_WORKER else 0))
    late = [f for f in faults if f.in_worker and f.step >= final_step]
    if late:
        raise UserError(
            f"the job is too short: faults planned at steps {[f.step for f in late]}, the run ends near step "
            f"{final_step}; train longer (more epochs) or use fewer --faults"
        )
    return faults


def pacing(count: int, final_step: int, every_steps: int, seconds_per_fault: float = SECONDS_PER_FAULT):
    """(checkpoint interval, pause after each step) for a run of `final_step` steps under `count` faults: at
    least two checkpoints between faults (the soak sees the run recover at a checkpoint), and about
    `seconds_per_fault` of training per fault, however fast the job's steps are."""
    every = max(1, min(every_steps, final_step // (2 * (count + 1))))
    return every, round(count * seconds_per_fault / max(1, final_step), 4)


def goodput(productive_seconds: float, wall_seconds: float) -> float:
    """The share of the faulted run's wall time that went into training that counted: the time the same work
    took uninterrupted (productive step time) over the faulted run's wall time, at most 1."""
    if wall_seconds <= 0 or productive_seconds < 0:
        raise ValueError(
            f"goodput needs wall_seconds > 0 and productive_seconds >= 0, got {wall_seconds}, {productive_seconds}"
        )
    return round(min(1.0, productive_seconds / wall_seconds), 4)


def lost_steps_after(
    fired_at: list[float], attempts: list[str], last_step: dict[str, int], resumed_from: dict[str, int]
) -> int:
    """Steps lost to the reclaims that fired at unix times `fired_at`: for each, the attempt that ran before
    the first attempt started after it had recorded up to some step; the next attempt resumed from an earlier
    one. Attempt ids are their start times in nanoseconds (elastic.worker.audit.new_attempt_id)."""
    lost = 0
    for moment in fired_at:
        after = [i for i, attempt in enumerate(attempts) if int(attempt) / 1e9 > moment]
        if not after or after[0] == 0:
            continue
        before, resumed = attempts[after[0] - 1], attempts[after[0]]
        lost += max(0, last_step[before] - resumed_from[resumed])
    return lost


def verdict(
    fixed_workers: bool,
    identical: bool,
    samples_exactly_once: bool,
    torn: list[str],
    planned: int,
    fired: int,
    loss_within_tolerance: bool,
) -> list[str]:
    """The problems that fail a soak (none: it passed). At one worker count the final state must be
    bit-identical; across counts the per-epoch loss must stay within the tolerance instead."""
    problems = []
    if fixed_workers and not identical:
        problems.append("final model and optimizer differ from the uninterrupted run's")
    if not fixed_workers and not loss_within_tolerance:
        problems.append("per-epoch loss moved beyond the tolerance across worker counts")
    if not samples_exactly_once:
        problems.append("not every sample was trained on exactly once per epoch")
    problems += [f"torn checkpoint loaded: {t}" for t in torn]
    if fired != planned:
        problems.append(f"{fired} of {planned} planned faults fired")
    return problems
