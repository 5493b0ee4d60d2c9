"""A sample ledger for `elastic verify-resume`: which samples each rank trained on at each step, across restarts.

Workers (with ELASTIC_AUDIT=1 in the job's environment) record, per optimizer step, the dataset indices the
session's loader handed to their rank and the step's loss. Records are flushed to ``<run>/audit/`` at every
checkpoint, before the state is staged, so every committed checkpoint is covered by durable records:

    audit/<attempt>/rank-00001-000000050.json   steps since the previous flush, up to step 50, from rank 1

An attempt is one start of the worker group (ids sort by start time). To rebuild the run's effective history,
attempts are replayed in order: each one resumed from a checkpoint at step r, so it supersedes every record
after r, and its own records follow. What remains is exactly the training the final weights came from.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

AUDIT_VARIABLE = "ELASTIC_AUDIT"
AUDIT_FOLDER = "audit"


# ---------------------------------------------------------------------------------------------------------
# Worker side


class NoLedger:
    """The null ledger: auditing is off."""

    def on_batch(self, epoch: int, indices: list[int]) -> None:
        pass

    def on_step(self, step: int, metrics: dict | None) -> None:
        pass

    def flush(self, step: int) -> None:
        pass

    def start_attempt(self, resumed_from: int, group=None, commit_time=None, load_started=None) -> None:
        pass


class SampleLedger:
    """Records this rank's batches per step; `flush` writes them to the run folder (called on every rank)."""

    def __init__(
        self,
        fs,
        run_root: str,
        rank: int,
        world_size: int,
        resumed_from: int,
        attempt: str,
        num_samples: int | None = None,
    ):
        self.fs = fs
        self.run_root = run_root
        self.rank = rank
        self.world_size = world_size
        self.resumed_from = resumed_from
        self.attempt = attempt
        self.num_samples = num_samples
        self._batches: list[tuple[int, list[int]]] = []
        self._records: list[dict] = []
        # Set at a restore: when the loaded checkpoint was committed and when its load began (unix times).
        self.resumed_commit_time: float | None = None
        self.load_started: float | None = None

    @property
    def folder(self) -> str:
        return f"{self.run_root}/{AUDIT_FOLDER}/{self.attempt}"

    def start_attempt(
        self, resumed_from: int, group=None, commit_time: float | None = None, load_started: float | None = None
    ) -> None:
        """At a restore (every rank): this attempt's records go under one id, made by rank 0 and broadcast on
        `group`; `commit_time`/`load_started` of the checkpoint loaded, if any."""
        import torch.distributed as dist  # the audit's reading side (verify-resume, reports) runs without torch

        attempt = [new_attempt_id()]
        if dist.is_initialized():
            dist.broadcast_object_list(attempt, src=0, group=group)
        self.attempt, self.resumed_from = attempt[0], resumed_from
        self.resumed_commit_time, self.load_started = commit_time, load_started

    def on_batch(self, epoch: int, indices: list[int]) -> None:
        self._batches.append((epoch, list(indices)))

    def on_step(self, step: int, metrics: dict | None) -> None:
        loss = (metrics or {}).get("loss")
        self._records.append(
            {"step": step, "batches": self._batches, "loss": float(loss) if isinstance(loss, (int, float)) else None}
        )
        self._batches = []

    def flush(self, step: int) -> None:
        if not self._records:
            return
        if not self.attempt:
            raise RuntimeError("the sample ledger has no attempt id: call session.restore() before training")
        payload = {
            "attempt": self.attempt,
            "rank": self.rank,
            "world_size": self.world_size,
            "resumed_from": self.resumed_from,
            "resumed_commit_time": self.resumed_commit_time,
            "load_started": self.load_started,
            "num_samples": self.num_samples,
            "records": self._records,
        }
        self.fs.makedirs(self.folder, exist_ok=True)
        with self.fs.open(f"{self.folder}/rank-{self.rank:05d}-{step:09d}.json", "w") as handle:
            json.dump(payload, handle)
        self._records = []


def audit_enabled() -> bool:
    return os.environ.get(AUDIT_VARIABLE) == "1"


def new_attempt_id() -> str:
    """Sorts by start time; rank 0 makes it and every rank uses the same."""
    return f"{time.time_ns():020d}"


# ---------------------------------------------------------------------------------------------------------
# Analysis


@dataclass
class StepRecord:
    step: int
    attempt: str
    world_size: int
    batches: dict[int, list[tuple[int, list[int]]]]  # rank -> [(epoch, indices)] (several with accumulation)
    loss: dict[int, float | None]


@dataclass
class History:
    """The effective training history of a run: one record per step, from the attempt that last ran it."""

    steps: dict[int, StepRecord] = field(default_factory=dict)
    attempts: list[str] = field(default_factory=list)
    num_samples: int | None = None
    resumed_from: dict[str, int] = field(default_factory=dict)  # attempt -> the checkpoint step it resumed from
    # attempt -> (commit time of the checkpoint it loaded, when the load began); attempts that resumed only
    restores: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    last_step: dict[str, int] = field(default_factory=dict)  # attempt -> the last step it recorded (superseded too)

    @property
    def final_step(self) -> int:
        return max(self.steps, default=0)

    def missing_steps(self) -> list[int]:
        return [s for s in range(1, self.final_step + 1) if s not in self.steps]

    def incomplete_steps(self) -> list[int]:
        """Steps without a record from every rank of the attempt that ran them."""
        return [s for s, r in sorted(self.steps.items()) if len(r.batches) != r.world_size]

    def epoch_counts(self) -> dict[int, Counter]:
        counts: dict[int, Counter] = defaultdict(Counter)
        for record in self.steps.values():
            for batches in record.batches.values():
                for epoch, indices in batches:
                    counts[epoch].update(indices)
        return dict(sorted(counts.items()))

    def epoch_losses(self) -> dict[int, float]:
        """Mean loss over each epoch's steps (ranks averaged per step)."""
        sums: dict[int, list[float]] = defaultdict(list)
        for record in self.steps.values():
            values = [v for v in record.loss.values() if v is not None]
            epochs = {e for batches in record.batches.values() for e, _ in batches}
            if values and len(epochs) == 1:
                sums[epochs.pop()].append(sum(values) / len(values))
        return {e: sum(v) / len(v) for e, v in sorted(sums.items())}


def read_history(fs, run_root: str) -> History:
    """Replay the attempts of a run in start order into its effective history."""
    by_attempt: dict[str, list[dict]] = defaultdict(list)
    fs.invalidate_cache(f"{run_root}/{AUDIT_FOLDER}")  # s3fs caches listings; other processes wrote these
    for path in sorted(fs.glob(f"{run_root}/{AUDIT_FOLDER}/*/rank-*.json")):
        with fs.open(path, "r") as handle:
            part = json.load(handle)
        by_attempt[part["attempt"]].append(part)
    history = History()
    for attempt in sorted(by_attempt):
        parts = by_attempt[attempt]
        resumed_from = parts[0]["resumed_from"]
        # This attempt restarted from the checkpoint at `resumed_from`: what came after it is superseded.
        for step in [s for s in history.steps if s > resumed_from]:
            del history.steps[step]
        history.attempts.append(attempt)
        history.resumed_from[attempt] = resumed_from
        if resumed_from:
            history.restores[attempt] = (parts[0].get("resumed_commit_time"), parts[0].get("load_started"))
        history.last_step[attempt] = max((r["step"] for part in parts for r in part["records"]), default=resumed_from)
        for part in parts:
            history.num_samples = part.get("num_samples") or history.num_samples
            for record in part["records"]:
                step = record["step"]
                entry = history.steps.get(step)
                if entry is None or entry.attempt != attempt:
                    entry = history.steps[step] = StepRecord(step, attempt, part["world_size"], {}, {})
                entry.batches[part["rank"]] = [(e, list(ix)) for e, ix in record["batches"]]
                entry.loss[part["rank"]] = record["loss"]
    return history


def torn_loads(history: History) -> list[str]:
    """The restores that loaded a torn checkpoint: one whose commit marker did not exist when the load began
    (no marker, or one written after). A ledger from before these records were kept counts as torn: unproven."""
    torn = []
    for attempt, (committed_at, load_started) in sorted(history.restores.items()):
        step = history.resumed_from[attempt]
        if committed_at is None or load_started is None:
            torn.append(f"attempt {attempt} loaded step {step} without a commit marker on record")
        elif committed_at > load_started:
            torn.append(f"attempt {attempt} loaded step {step}, committed {committed_at - load_started:.3f} s later")
    return torn


@dataclass(frozen=True)
class Divergence:
    """The first step whose loss differs between two runs of the same job at the same worker count."""

    step: int
    baseline: dict[int, float | None]  # rank -> loss
    other: dict[int, float | None]
    resumed_from: int  # the checkpoint the other run's attempt that ran this step had resumed from (0: none)

    def __str__(self) -> str:
        since = (
            f"resumed from the checkpoint of step {self.resumed_from}" if self.resumed_from else "no resume before it"
        )
        ranks = ", ".join(
            f"rank {r}: {self.other.get(r)!r} against {self.baseline.get(r)!r}"
            for r in sorted(set(self.baseline) | set(self.other))
            if self.other.get(r) != self.baseline.get(r)
        )
        return f"step {self.step} ({since}; {ranks})"


def first_divergence(baseline: History, other: History) -> Divergence | None:
    """The first step both runs took whose per-rank losses are not bit-equal, or None. A step one of them lacks
    is not compared (the exactly-once check reports missing steps), nor one without a loss on either side (a
    Trainer's logs come every logging_steps, and a restarted attempt has none until its first)."""
    for step in sorted(set(baseline.steps) & set(other.steps)):
        mine, theirs = baseline.steps[step], other.steps[step]
        unrecorded = None in mine.loss.values() or None in theirs.loss.values()
        if not unrecorded and not _same_losses(mine.loss, theirs.loss):
            return Divergence(step, dict(mine.loss), dict(theirs.loss), other.resumed_from.get(theirs.attempt, 0))
    return None


def _same_losses(a: dict[int, float | None], b: dict[int, float | None]) -> bool:
    """Bit-equal per rank; a NaN equals a NaN (a step skipped for a non-finite loss in both runs)."""

    def same(x: float | None, y: float | None) -> bool:
        return x == y or (x is not None and y is not None and math.isnan(x) and math.isnan(y))

    return a.keys() == b.keys() and all(same(a[rank], b[rank]) for rank in a)


@dataclass(frozen=True)
class ExactlyOnce:
    ok: bool
    epochs_checked: int
    problems: list[str]


def check_exactly_once(history: History, complete_epochs: int | None = None) -> ExactlyOnce:
    """Every sample of every epoch exactly once: no duplicates, nothing skipped, no step missing.

    The last epoch may be partial (a run that stopped mid-epoch) unless `complete_epochs` says how many
    epochs must be whole; a partial epoch must still have no duplicates."""
    problems: list[str] = []
    missing = history.missing_steps()
    if missing:
        problems.append(f"no record of steps {_ranges(missing)}")
    incomplete = history.incomplete_steps()
    if incomplete:
        problems.append(f"steps {_ranges(incomplete)} lack a record from some rank")
    counts = history.epoch_counts()
    size = history.num_samples
    if not counts:
        problems.append("the ledger is empty: did the job use session.loader()?")
    last = max(counts, default=-1)
    for epoch, counter in counts.items():
        duplicated = sorted(i for i, n in counter.items() if n > 1)
        if duplicated:
            problems.append(f"epoch {epoch}: {len(duplicated)} samples seen more than once, e.g. {duplicated[:5]}")
        must_be_whole = epoch < last or (complete_epochs is not None and epoch < complete_epochs)
        if size is not None and must_be_whole:
            skipped = sorted(set(range(size)) - set(counter))
            if skipped:
                problems.append(f"epoch {epoch}: {len(skipped)} samples never seen, e.g. {skipped[:5]}")
    if complete_epochs is not None and len(counts) < complete_epochs:
        problems.append(f"only {len(counts)} epochs recorded, expected {complete_epochs}")
    return ExactlyOnce(not problems, len(counts), problems)


def _ranges(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}..{steps[-1]} ({len(steps)} steps)"
