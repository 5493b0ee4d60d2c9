"""GPU-hours, node-hours and cost of a run by market, from its placements and the nodes its worker groups ran
on. A placement holds its workers' resources from its start to its end (the driver's record); each worker
takes its share of its node (its GPUs over the node's GPUs, or on a node without GPUs its CPUs over the
node's), and a node costs its instance type's price in its market. `all_on_demand` prices the same node
shares at on-demand rates; savings is the difference."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from elastic.accounting.prices import PriceTable
from elastic.ledger.events import Event, PlacementEnded, PlacementStarted, WorkersStarted

MARKETS = ("spot", "on-demand")


@dataclass(frozen=True)
class PlacementSpan:
    """A placement as the report shows it: when it held its workers, where, and why it ended."""

    id: str
    market: str
    workers: int
    started: float
    ended: float
    ended_by: str
    step: int | None
    gpus_per_worker: float
    cpus_per_worker: float
    nodes: list = field(default_factory=list)  # WorkersStarted.nodes of its first worker group ([] if none)

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "market": self.market,
            "workers": self.workers,
            "started": round(self.started, 3),
            "ended": round(self.ended, 3),
            "seconds": round(self.ended - self.started, 3),
            "ended_by": self.ended_by,
            "ended_at_step": self.step,
            "gpus_per_worker": self.gpus_per_worker,
            "nodes": [n.get("node_id") for n in self.nodes],
            "instance_types": sorted({n.get("instance_type") or "unlabelled" for n in self.nodes}),
        }


@dataclass
class Usage:
    gpu_hours: dict[str, float]
    node_hours: dict[str, float]
    cost: dict[str, float]  # actual, all_on_demand, savings (USD)
    unpriced_node_hours: float
    instance_types: dict[str, float]  # node-hours by instance type


def placements(events: list[Event], run_end: float | None = None) -> list[PlacementSpan]:
    """The driver's placements, each paired with its end and the nodes of its first worker group. A placement
    with no end (the driver died) ends at `run_end`."""
    starts = [e for e in events if isinstance(e, PlacementStarted)]
    ends = [e for e in events if isinstance(e, PlacementEnded)]
    groups = [e for e in events if isinstance(e, WorkersStarted)]
    spans = []
    for start in starts:
        end = next((e for e in ends if e.placement == start.placement and e.time >= start.time), None)
        if end is not None:
            ends.remove(end)
        finish = end.time if end is not None else (run_end if run_end is not None else start.time)
        group = next(
            (g for g in groups if start.time <= g.time <= finish and (g.placement or "") == (start.placement or "")),
            None,
        )
        spans.append(
            PlacementSpan(
                id=start.placement,
                market=start.market,
                workers=group.world_size if group is not None else start.workers,
                started=start.time,
                ended=finish,
                ended_by=end.ended_by if end is not None else "unknown (the driver left no end)",
                step=end.step if end is not None else None,
                gpus_per_worker=group.gpus_per_worker if group is not None else start.gpus_per_worker,
                cpus_per_worker=group.cpus_per_worker if group is not None else start.cpus_per_worker,
                nodes=list(group.nodes) if group is not None else [],
            )
        )
    return spans


def node_share(node: dict, gpus: float, cpus: float) -> float:
    """The part of its node one worker holds: GPUs over the node's GPUs, else CPUs over the node's CPUs."""
    if node.get("node_gpus"):
        return min(1.0, gpus / node["node_gpus"])
    if node.get("node_cpus"):
        return min(1.0, cpus / node["node_cpus"])
    return 1.0


def usage(spans: list[PlacementSpan], prices: PriceTable) -> Usage:
    gpu_hours = dict.fromkeys(MARKETS, 0.0)
    node_hours = dict.fromkeys(MARKETS, 0.0)
    by_type: dict[str, float] = defaultdict(float)
    actual = on_demand = unpriced = 0.0
    for span in spans:
        hours = max(0.0, span.ended - span.started) / 3600
        # Without a worker group (called off before it trained) its workers are counted on unknown nodes.
        nodes = span.nodes or [{"market": span.market, "instance_type": ""}] * span.workers
        for node in nodes:
            market = node.get("market") if node.get("market") in MARKETS else span.market
            market = market if market in MARKETS else "on-demand"
            share = node_share(node, span.gpus_per_worker, span.cpus_per_worker)
            gpu_hours[market] += span.gpus_per_worker * hours
            node_hours[market] += share * hours
            kind = node.get("instance_type") or ""
            by_type[kind or "unlabelled"] += share * hours
            price, full = prices.price(kind, market), prices.price(kind, "on-demand")
            if price is None or full is None:
                unpriced += share * hours
                continue
            actual += share * hours * price
            on_demand += share * hours * full
    return Usage(
        gpu_hours={k: round(v, 6) for k, v in gpu_hours.items()},
        node_hours={k: round(v, 6) for k, v in node_hours.items()},
        cost={
            "actual": round(actual, 6),
            "all_on_demand": round(on_demand, 6),
            "savings": round(on_demand - actual, 6),
        },
        unpriced_node_hours=round(unpriced, 6),
        instance_types={k: round(v, 6) for k, v in by_type.items()},
    )
