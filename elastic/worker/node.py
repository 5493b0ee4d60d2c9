"""Where this worker runs: its device, its node and that node's market (spot / on-demand)."""

from __future__ import annotations

import torch

from elastic.placement.labels import MARKET_LABEL


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
