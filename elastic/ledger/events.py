"""Every event of the run ledger, typed: frozen dataclasses with `kind` (their JSON tag), `time` (unix seconds,
when the thing began) and `to_dict` / `from_dict`. Written as one JSON object per line.

Who writes what:
- the driver (run or sweep trial): RunStarted/RunEnded, CapacityWaited, PlacementStarted/PlacementEnded,
  NodeDied (read back from Ray at the end of the run);
- rank 0 of each worker group (an "attempt": a placement's workers, or Ray Train's restart of them):
  WorkersStarted, Restored, Steps (aggregated step timing, not one event per step), CheckpointCommitted,
  PreemptionNotice, AttemptEnded;
- a sweep's driver: SweepStarted/SweepEnded.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar


@dataclass(frozen=True)
class Event:
    kind: ClassVar[str] = ""
    time: float

    def to_dict(self) -> dict:
        return {"kind": self.kind, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Event | None:
        """The event a JSON object describes, or None (unknown kind, missing field: a newer or torn line)."""
        kind = EVENT_TYPES.get(data.get("kind", ""))
        if kind is None:
            return None
        known = {f.name for f in fields(kind)}
        try:
            return kind(**{k: v for k, v in data.items() if k in known})
        except TypeError:
            return None


@dataclass(frozen=True)
class RunStarted(Event):
    """A driver started the run (again: a resubmitted run has one per job). `kind_of_run`: run | trial."""

    kind: ClassVar[str] = "run_started"
    run: str = ""
    kind_of_run: str = "run"
    market: str = ""
    workers_min: int = 0
    workers_max: int = 0


@dataclass(frozen=True)
class RunEnded(Event):
    kind: ClassVar[str] = "run_ended"
    status: str = ""
    error: str | None = None


@dataclass(frozen=True)
class CapacityWaited(Event):
    """The driver waited from `time` to `ended` for capacity (spot-first's wait for spot, or free slots)."""

    kind: ClassVar[str] = "capacity_waited"
    ended: float = 0.0
    market: str = ""
    reason: str = ""


@dataclass(frozen=True)
class PlacementStarted(Event):
    """The driver started a placement (one Ray Train fit()): `workers` workers on `market` nodes."""

    kind: ClassVar[str] = "placement_started"
    placement: str = ""
    market: str = ""
    workers: int = 0
    cpus_per_worker: float = 0.0
    gpus_per_worker: float = 0.0
    reason: str = ""
    follows: str | None = None


@dataclass(frozen=True)
class PlacementEnded(Event):
    """Its fit() returned (`time`): ended_by preemption | swap | grow (at the checkpoint of `step`), finished,
    failed, controller error, or called off."""

    kind: ClassVar[str] = "placement_ended"
    placement: str = ""
    ended_by: str = ""
    step: int | None = None


@dataclass(frozen=True)
class NodeDied(Event):
    """A node the run had trained on died at `time` (Ray's record of the node), e.g. a reclaimed spot node."""

    kind: ClassVar[str] = "node_died"
    node_id: str = ""
    message: str = ""


@dataclass(frozen=True)
class WorkersStarted(Event):
    """Rank 0 of a worker group, before its first step. `nodes`: one entry per rank: node_id, market,
    instance_type (the node's elastic-instance-type label, "" without one), node_cpus, node_gpus."""

    kind: ClassVar[str] = "workers_started"
    attempt: str = ""
    placement: str | None = None
    world_size: int = 0
    cpus_per_worker: float = 0.0
    gpus_per_worker: float = 0.0
    nodes: list = field(default_factory=list)


@dataclass(frozen=True)
class Restored(Event):
    """The attempt loaded the checkpoint of `step` from `time` to `ended`."""

    kind: ClassVar[str] = "restored"
    attempt: str = ""
    ended: float = 0.0
    step: int = 0
    from_world_size: int = 0
    world_size: int = 0


@dataclass(frozen=True)
class Steps(Event):
    """Steps first_step..last_step took the wall time from `time` to `ended` (checkpoint stalls included:
    CheckpointCommitted says how long). Windows of one attempt are contiguous; `metrics`: the numeric metrics
    of the last step (the loss curve)."""

    kind: ClassVar[str] = "steps"
    attempt: str = ""
    ended: float = 0.0
    first_step: int = 0
    last_step: int = 0
    metrics: dict = field(default_factory=dict)
    data_wait_s: float = 0.0  # of the window's time, what the loop spent waiting for batches (rank 0)


@dataclass(frozen=True)
class CheckpointCommitted(Event):
    """A save of `step` began at `time` and committed at `committed`; the training loop was held `stall_s`."""

    kind: ClassVar[str] = "checkpoint_committed"
    attempt: str = ""
    committed: float = 0.0
    step: int = 0
    reason: str = ""
    save_s: float = 0.0
    stall_s: float = 0.0


@dataclass(frozen=True)
class PreemptionNotice(Event):
    """A reclaim notice for `node_ids` reached the attempt at `step`; the cloud's `deadline` (unix s)."""

    kind: ClassVar[str] = "preemption_notice"
    attempt: str = ""
    step: int = 0
    node_ids: list = field(default_factory=list)
    deadline: float | None = None


HANG_REASON = "hang"  # AttemptEnded.reason of a worker group the hang watchdog ended (elastic.worker.watchdog)


@dataclass(frozen=True)
class AttemptEnded(Event):
    """The attempt left after the checkpoint of `step` (reason: preemption, swap, grow, finished), or was ended
    by the hang watchdog after `step`, its last (reason: hang)."""

    kind: ClassVar[str] = "attempt_ended"
    attempt: str = ""
    step: int = 0
    reason: str = ""


@dataclass(frozen=True)
class SweepStarted(Event):
    kind: ClassVar[str] = "sweep_started"
    sweep: str = ""
    gpus_available: float = 0.0
    share: float = 0.0
    num_samples: int = 0


@dataclass(frozen=True)
class SweepEnded(Event):
    """`trials`: one entry per trial: trial_id, run_name, state, gpu_share, metric."""

    kind: ClassVar[str] = "sweep_ended"
    trials: list = field(default_factory=list)


EVENT_TYPES: dict[str, type[Event]] = {
    kind.kind: kind
    for kind in (
        RunStarted,
        RunEnded,
        CapacityWaited,
        PlacementStarted,
        PlacementEnded,
        NodeDied,
        WorkersStarted,
        Restored,
        Steps,
        CheckpointCommitted,
        PreemptionNotice,
        AttemptEnded,
        SweepStarted,
        SweepEnded,
    )
}


def numeric(metrics: dict | None) -> dict[str, Any]:
    """The int/float entries of a metrics mapping (what a Steps event keeps)."""
    return {
        k: float(v)
        for k, v in (metrics or {}).items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN
    }
