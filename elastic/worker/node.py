"""Where this worker runs: its device, its node and that node's market (spot / on-demand)."""

from __future__ import annotations

import torch

from elastic.placement.labels import INSTANCE_TYPE_LABEL, MARKET_LABEL


def worker_device(local_rank: int) -> torch.device:
    """The GPU of this local rank (made current, so CUDA calls and RNG streams default to it), else the CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def node_identity() -> tuple[str, str]:
    """This node's Ray id and its market label ("unknown" without one)."""
    import ray  # deferred: the worker-only Ray context (importing the session needs no Ray)

    node_id = ray.get_runtime_context().get_node_id()
    labels = {}
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            labels = node.get("Labels") or {}
    return node_id, labels.get(MARKET_LABEL, "unknown")


def describe_nodes(node_ids: list[str]) -> list[dict]:
    """For the run ledger, one entry per rank: its node's id, market, instance type (the node's
    elastic-instance-type label; "" without one) and total CPUs and GPUs."""
    import ray  # deferred, as in node_identity

    known = {node.get("NodeID"): node for node in ray.nodes()}
    described = []
    for node_id in node_ids:
        node = known.get(node_id) or {}
        labels = node.get("Labels") or {}
        resources = node.get("Resources") or {}
        described.append(
            {
                "node_id": node_id,
                "market": labels.get(MARKET_LABEL, "unknown"),
                "instance_type": labels.get(INSTANCE_TYPE_LABEL, ""),
                "node_cpus": float(resources.get("CPU", 0.0)),
                "node_gpus": float(resources.get("GPU", 0.0)),
            }
        )
    return described


def worker_resources() -> tuple[float, float]:
    """The CPUs and GPUs (or GPU share) Ray assigned to this worker."""
    import ray  # deferred, as in node_identity

    assigned = ray.get_runtime_context().get_assigned_resources()
    return float(assigned.get("CPU", 0.0)), float(assigned.get("GPU", 0.0))
