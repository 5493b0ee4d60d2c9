"""Training jobs that `elastic bench recovery` runs: the same model and data through our harness and through a
bare Ray Train loop with Ray's own checkpointing, each writing a timeline of its steps.

The timeline is a folder of small text files on the machine's disk (the benchmark runs on the local cluster,
whose nodes share it): per attempt, a start line from every rank (resumed step and node) and a line per step
from rank 0, flushed as it is written, so a step is on record once it is done even if the node then dies.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from elastic.placement.labels import worker_selector
from elastic.storage import pyarrow_filesystem

SAMPLES = 16_384  # x 1024 features: 64 MB per worker


def model_and_data(width: int, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1))
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(SAMPLES, width, generator=generator)
    targets = inputs[:, :1] * 0.5 + 0.1 * torch.randn(SAMPLES, 1, generator=generator)
    return model, torch.utils.data.TensorDataset(inputs, targets)


class Timeline:
    """Appends to <folder>/<attempt>-rank<r>.log: `start STEP NODE TIME` once, then `step STEP TIME` (rank 0)."""

    def __init__(self, folder: str, rank: int, node_id: str, start_step: int):
        self.rank = rank
        Path(folder).mkdir(parents=True, exist_ok=True)
        self._file = open(Path(folder) / f"{time.time():.6f}-{uuid.uuid4().hex[:6]}-rank{rank}.log", "a")
        self._write(f"start {start_step} {node_id} {time.time():.6f}")

    def step(self, step: int) -> None:
        if self.rank == 0:
            self._write(f"step {step} {time.time():.6f}")

    def _write(self, line: str) -> None:
        self._file.write(line + "\n")
        self._file.flush()


def read_timeline(folder: str) -> list[dict]:
    """Attempts in start order: {"start": step, "started": time, "nodes": {rank: node}, "steps": [(step, time)]}."""
    attempts: dict[str, dict] = {}
    for path in sorted(Path(folder).glob("*.log")):
        key, _, rank_part = path.stem.rpartition("-rank")
        lines = path.read_text().splitlines()
        if not lines:
            continue
        _, start, node, started = lines[0].split()
        # the ranks of one attempt start within a second of each other: group them under rank 0's file
        attempts.setdefault(
            path.name,
            {
                "start": int(start),
                "started": float(started),
                "rank": int(rank_part),
                "node": node,
                "steps": [(int(s), float(t)) for _, s, t in (line.split() for line in lines[1:])],
            },
        )
    ranks0 = sorted((a for a in attempts.values() if a["rank"] == 0), key=lambda a: a["started"])
    for attempt in ranks0:
        attempt["nodes"] = sorted(
            {
                a["node"]
                for a in attempts.values()
                if abs(a["started"] - attempt["started"]) < 30 and a["start"] == attempt["start"]
            }
        )
    return ranks0


# ---------------------------------------------------------------------------------------------------------
# Ours: the harness (entrypoint elastic.bench.jobs:harness_train)


def harness_train(session) -> None:
    cfg = session.config
    model, data = model_and_data(cfg["width"])
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = session.loader(data, batch_size=cfg["batch"], seed=0)
    start = session.restore()
    timeline = Timeline(cfg["timeline"], session.rank, session.node_id, start)
    for _, (x, y) in loader.epochs(10**6):
        if session.step_count >= cfg["steps"]:
            break
        loss = F.mse_loss(model(x), y)
        try:
            session.optimize(loss)
        finally:  # also when the step ends the placement at a just-in-time checkpoint: that step is done
            timeline.step(session.step_count)
    session.finish()


# ---------------------------------------------------------------------------------------------------------
# Bare Ray Train: Ray's documented pattern (torch.save to a temp dir, ray.train.report uploads it)


def _bare_loop(config: dict) -> None:
    import tempfile

    import ray
    import ray.train
    import ray.train.torch

    model, data = model_and_data(config["width"])
    model = ray.train.torch.prepare_model(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    step = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(Path(folder) / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
    timeline = Timeline(config["timeline"], rank, ray.get_runtime_context().get_node_id(), step)
    batch = config["batch"]
    while step < config["steps"]:
        start = ((step * world + rank) * batch) % (SAMPLES - batch)
        x, y = data.tensors[0][start : start + batch], data.tensors[1][start : start + batch]
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        timeline.step(step)
        if step % config["every_steps"] == 0:
            with tempfile.TemporaryDirectory() as folder:
                saved = None
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                        Path(folder) / "state.pt",
                    )
                    saved = ray.train.Checkpoint.from_directory(folder)
                ray.train.report({"step": step}, checkpoint=saved)


def bare_main(argv: list[str]) -> None:
    """`python -m elastic.bench.jobs NAME TIMELINE STEPS WIDTH BATCH EVERY URI WORKERS`, as a Ray job."""
    name, timeline, steps, width, batch, every, uri, workers = argv
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto")
    filesystem, storage_path = pyarrow_filesystem(uri)
    TorchTrainer(
        _bare_loop,
        train_loop_config={
            "timeline": timeline,
            "steps": int(steps),
            "width": int(width),
            "batch": int(batch),
            "every_steps": int(every),
        },
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(
            num_workers=int(workers), resources_per_worker={"CPU": 1}, label_selector=worker_selector("spot")
        ),
        run_config=RunConfig(
            name=name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            failure_config=FailureConfig(max_failures=-1, max_preemption_failures=-1),
        ),
    ).fit()


if __name__ == "__main__":
    bare_main(sys.argv[1:])
