"""What verify-resume and the chaos soak share: an audited copy of a job's spec, and reading a run's records back
(its checkpoints, its sample ledger, the markers its planned faults left, its final state against another run's)."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.checkpoint.store import CheckpointStore, run_directory
from elastic.config.spec import JobSpec
from elastic.worker.audit import AUDIT_VARIABLE, History, read_history
from elastic.worker.chaos import KILL_AT_VARIABLE, STEP_SECONDS_VARIABLE, Kill, format_plan


def audited_spec(
    spec: JobSpec, workers: int, plan: list[Kill], max_failures: int, step_seconds: float = 0.0
) -> JobSpec:
    """The job at a fixed worker count, with the sample ledger on and the in-worker faults of `plan`
    (`step_seconds`: a pause after every step, elastic.worker.chaos)."""
    env = {**spec.runtime_env.env_vars, AUDIT_VARIABLE: "1"}
    if plan:
        env[KILL_AT_VARIABLE] = format_plan(plan)
    if step_seconds:
        env[STEP_SECONDS_VARIABLE] = f"{step_seconds:.4f}"
    return spec.model_copy(
        update={
            "workers": spec.workers.model_copy(update={"min": workers, "max": workers}),
            "failure": spec.failure.model_copy(update={"max_failures": max_failures}),
            "runtime_env": spec.runtime_env.model_copy(update={"env_vars": env}),
        }
    )


@dataclass(frozen=True)
class FinalComparison:
    """Two runs' latest committed checkpoints, tensor by tensor (model and optimizer)."""

    identical: bool
    max_abs_diff: float
    compared: int
    changed: list[str]


class RunRecords:
    """The records of the runs of one job, read from its checkpoint storage."""

    def __init__(self, spec: JobSpec):
        self.spec = spec

    def store(self, run_name: str) -> CheckpointStore:
        return CheckpointStore(run_directory(self.spec, run_name))

    def history(self, run_name: str) -> History:
        store = self.store(run_name)
        return read_history(store.fs, store.root)

    def latest_step(self, run_name: str) -> int:
        latest = self.store(run_name).latest_committed()
        return latest.step if latest else 0

    def fired(self, run_name: str, kind: str) -> list[str]:
        """Markers of the in-worker faults of `kind` (kill, notice) that fired, e.g. kill-save-40-rank-0."""
        store = self.store(run_name)
        store.fs.invalidate_cache(f"{store.root}/chaos")
        return sorted(path.rsplit("/", 1)[-1] for path in store.fs.glob(f"{store.root}/chaos/{kind}-*"))

    def compare_final(self, run_a: str, run_b: str) -> FinalComparison:
        import torch  # heavy; only once both runs are over

        store_a, store_b = self.store(run_a), self.store(run_b)
        latest_a, latest_b = store_a.latest_committed(), store_b.latest_committed()
        a = store_a.read_tensors(latest_a.step) if latest_a else {}
        b = store_b.read_tensors(latest_b.step) if latest_b else {}
        common = [k for k in a if k in b and a[k].shape == b[k].shape]
        identical = (
            bool(a) and a.keys() == b.keys() and len(common) == len(a) and all(torch.equal(a[k], b[k]) for k in common)
        )
        diffs = [(a[k].double() - b[k].double()).abs().max().item() for k in common if a[k].numel()]
        changed = [k for k in common if not torch.equal(a[k], b[k])]
        return FinalComparison(identical, max(diffs, default=float("inf")), len(common), changed)


def samples(history: History, up_to_step: int) -> int:
    """Samples trained on in the steps up to `up_to_step` of a run's effective history."""
    return sum(
        len(ix)
        for s, r in history.steps.items()
        if s <= up_to_step
        for batches in r.batches.values()
        for _, ix in batches
    )
