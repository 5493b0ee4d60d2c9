"""Whether a job's workers can ever fit a cluster's worker nodes: the check `submit` runs, so a request no node can
hold is answered at once with the numbers instead of a run that waits forever for capacity. Pure: node views in
(their total resources, free or not), a verdict with its one-line reason out."""

from __future__ import annotations

import math
from dataclasses import dataclass

from elastic.config.spec import WorkersSpec
from elastic.placement.policy import ANY, ON_DEMAND, SPOT, NodeView, worker_resources

# The markets a job's workers may ever run on: spot-first runs on on-demand when spot is short.
_MARKETS = {"spot": (SPOT,), "on-demand": (ON_DEMAND,), "any": (ANY,), "spot-first": (SPOT, ON_DEMAND)}


@dataclass(frozen=True)
class Feasibility:
    """`problem` is set when the cluster as it stands cannot hold workers.min workers of the job's shape."""

    problem: str | None = None
    capacity: int = 0  # most workers of this shape the best allowed market holds, all its nodes empty


def slots_on(node: NodeView, workers: WorkersSpec) -> int:
    """Workers of this shape an empty `node` holds (its totals, not what is free now)."""
    fits = [math.floor(node.total.get(name, 0.0) / amount + 1e-9) for name, amount in worker_resources(workers).items()]
    return min(fits)


def check_feasible(workers: WorkersSpec, nodes: list[NodeView]) -> Feasibility:
    """Can the worker nodes of the markets this job may use hold workers.min workers? With no labelled worker node
    at all (a cluster that autoscales from zero) there is nothing to judge: feasible."""
    candidates = [n for n in nodes if n.is_worker]
    if not candidates:
        return Feasibility()
    best_market, best = "", -1
    for market in _MARKETS[workers.market]:
        on_market = [n for n in candidates if market == ANY or n.market == market]
        capacity = sum(slots_on(n, workers) for n in on_market)
        if capacity > best:
            best_market, best = market, capacity
    if best >= workers.min:
        return Feasibility(capacity=best)
    where = "worker nodes" if best_market == ANY else f"{best_market} worker nodes"
    on_market = [n for n in candidates if best_market == ANY or n.market == best_market]
    need = worker_resources(workers)
    if best == 0:
        biggest = max(on_market, key=lambda n: tuple(n.total.get(k, 0.0) for k in need), default=None)
        has = ", ".join(f"{_g(biggest.total.get(k, 0.0) if biggest else 0)} {k}" for k in need)
        return Feasibility(
            f"workers: one worker needs {_shape(need)} but the largest of the {len(on_market)} {where} has {has}; "
            f"lower {' or '.join(f'workers.{_field(k)}' for k in need)} or add bigger nodes",
            0,
        )
    return Feasibility(
        f"workers.min: {workers.min} workers of {_shape(need)} each do not fit: the {len(on_market)} {where} hold "
        f"at most {best}; lower workers.min to {best} or add nodes",
        best,
    )


def _shape(need: dict[str, float]) -> str:
    return " + ".join(f"{_g(v)} {k}" for k, v in need.items())


def _field(resource: str) -> str:
    return {"CPU": "cpus", "GPU": "gpus"}[resource]


def _g(value: float) -> str:
    return f"{value:g}"
