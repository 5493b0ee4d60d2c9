"""Spot-first placement policy, pure: cluster nodes + the workers spec in, a `Decision` with its reason out
(spot or on-demand at start, swap back to spot, how many workers fit, grow). No Ray, no I/O: the driver
(elastic.driver.capacity) observes the nodes and carries the decisions out, and logs every one.

Why a placement ends by the training function *returning*: when every worker's function returns, Ray Train's
controller moves to FINISHED and `fit()` returns a Result. No error is raised, so neither `max_failures` nor
`max_preemption_failures` is spent, and nothing is killed mid-save. (Aborting the controller instead exits the
controller actor, so `fit()` raises; raising in the workers is a worker-group error that FailureConfig retries on
the *same* placement.) The driver then calls `fit()` again with the spot selector under the same run name: Ray
resumes the run, and `session.restore()` loads the checkpoint the placement ended at, so no step is lost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic.config.spec import WorkersSpec
from elastic.placement.labels import MARKET_LABEL, ROLE_LABEL, WORKER_ROLE

SPOT, ON_DEMAND, ANY = "spot", "on-demand", "any"
POLL_SECONDS_VARIABLE = "ELASTIC_PLACEMENT_POLL_SECONDS"
DEFAULT_POLL_SECONDS = 5.0


@dataclass(frozen=True)
class NodeView:
    """What the policy needs to know of one live node."""

    node_id: str
    labels: dict[str, str]
    available: dict[str, float]  # free resources now
    draining: bool = False  # a drained node (e.g. a spot notice) is leaving: its capacity does not count
    total: dict[str, float] = field(default_factory=dict)  # the node's resources, free or not (if known)

    @property
    def market(self) -> str | None:
        return self.labels.get(MARKET_LABEL)

    @property
    def is_worker(self) -> bool:
        return self.labels.get(ROLE_LABEL) == WORKER_ROLE


@dataclass(frozen=True)
class Decision:
    """A placement decision and why. action: spot | on-demand | wait (start); swap | stay (while on on-demand)."""

    action: str
    reason: str
    spot_slots: int = 0


def worker_resources(workers: WorkersSpec) -> dict[str, float]:
    resources = {"CPU": workers.cpus}
    if workers.gpus_at_most:
        resources["GPU"] = workers.gpus_at_most
    return resources


def worker_slots(
    nodes: list[NodeView], workers: WorkersSpec, market: str, released: dict[str, int] | None = None
) -> int:
    """How many more workers of this shape fit on the live worker nodes of `market`: right now, plus the
    slots that `released` workers (node id -> workers of a placement that is ending) are about to free.
    Capped at the node's total, so a slot already freed is not counted twice."""
    need = worker_resources(workers)
    released = released or {}
    total = 0
    for node in nodes:
        if node.draining or not node.is_worker or (market != ANY and node.market != market):
            continue
        fits = []
        for name, amount in need.items():
            free = node.available.get(name, 0.0) + released.get(node.node_id, 0) * amount
            if name in node.total:
                free = min(free, node.total[name])
            # A little slack: Ray reports fractional resources as floats (0.1 * 10 is not 1.0).
            fits.append(math.floor(free / amount + 1e-9))
        total += min(fits)
    return total


def decide_start(workers: WorkersSpec, nodes: list[NodeView], waited_seconds: float) -> Decision:
    """spot-first at start: spot once it can hold workers.min; on-demand once spot_wait_seconds have passed."""
    slots = worker_slots(nodes, workers, SPOT)
    if slots >= workers.min:
        return Decision(SPOT, f"spot capacity for {workers.min} worker(s) is free ({slots} slot(s))", slots)
    if waited_seconds >= workers.spot_wait_seconds:
        return Decision(
            ON_DEMAND,
            f"spot capacity was not granted within {workers.spot_wait_seconds:g} s "
            f"({slots} of {workers.min} spot worker slot(s) free); falling back to on-demand",
            slots,
        )
    return Decision(
        "wait",
        f"waiting for spot capacity: {slots} of {workers.min} spot worker slot(s) free "
        f"after {waited_seconds:.0f} of {workers.spot_wait_seconds:g} s",
        slots,
    )


def decide_swap(workers: WorkersSpec, nodes: list[NodeView]) -> Decision:
    """While on on-demand: swap to spot once spot can hold workers.min (the same bar as at start)."""
    slots = worker_slots(nodes, workers, SPOT)
    if not workers.swap_to_spot:
        return Decision("stay", "swap_to_spot is off", slots)
    if slots >= workers.min:
        return Decision(
            "swap",
            f"spot capacity for {workers.min} worker(s) is back ({slots} slot(s) free); "
            "swapping at the next checkpoint",
            slots,
        )
    return Decision("stay", f"{slots} of {workers.min} spot worker slot(s) free", slots)


def decide_workers(
    workers: WorkersSpec, nodes: list[NodeView], market: str, released: dict[str, int] | None = None
) -> Decision:
    """How many workers a new placement on `market` starts with: as many as fit, up to max (action start), or
    wait while fewer than min fit (a reclaimed node not yet replaced). `released`: see worker_slots."""
    slots = worker_slots(nodes, workers, market, released)
    if slots >= workers.min:
        count = min(slots, workers.max_workers)
        return Decision("start", f"{count} worker(s) on {market} nodes ({slots} slot(s) free)", count)
    return Decision(
        "wait",
        f"waiting for capacity: {slots} of {workers.min} worker slot(s) free on {market} nodes "
        "(a reclaimed node not yet replaced?)",
        slots,
    )


def decide_grow(workers: WorkersSpec, nodes: list[NodeView], market: str, running: int | None) -> Decision:
    """While an elastic placement runs below max: grow once free slots for more workers exist."""
    slots = worker_slots(nodes, workers, market)
    if running is None:
        return Decision("stay", "worker group not running yet", slots)
    if running >= workers.max_workers:
        return Decision("stay", f"at max ({running} workers)", slots)
    if slots >= 1:
        target = min(workers.max_workers, running + slots)
        return Decision(
            "grow",
            f"capacity for {target - running} more worker(s) on {market} nodes; growing "
            f"{running} -> {target} at the next checkpoint",
            slots,
        )
    return Decision("stay", f"{running} of {workers.max_workers} workers, no free slot on {market} nodes", slots)
