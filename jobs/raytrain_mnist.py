"""A Ray Train worker function in the shape of Ray's FashionMNIST example (python/ray/train/examples/pytorch/),
on the in-repo handwritten digits (jobs/data/digits.npz: nothing is downloaded), run by elastic with
`api: ray-train`. Nothing here imports elastic's session: it is plain Ray Train plus two additions any Ray Train
user makes for fault tolerance (get_checkpoint at the start, a checkpoint in report) and one line for spot
nodes: it reports a checkpoint when `elastic.train.checkpoint_requested()` says a reclaim is near, so a
preemption loses no step. It runs unchanged under `TorchTrainer(train_func_per_worker, ...)` too (the hint is
then always False).

A step here is one `ray.train.report` (every `report_every` batches): elastic counts steps in reports. The
model has no dropout (the example's has), so nothing draws from the random streams and a resume at the same
worker count is bit-identical: the sampler's order comes from (seed, epoch), the position from the checkpoint.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import ray.train
import ray.train.torch
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import elastic.train

DATA = Path(__file__).parent / "data" / "digits.npz"


class NeuralNetwork(nn.Module):
    def __init__(self, width: int = 512):
        super().__init__()
        self.flatten = nn.Flatten()
        self.linear_relu_stack = nn.Sequential(
            nn.Linear(8 * 8, width),
            nn.ReLU(),
            nn.Linear(width, width),
            nn.ReLU(),
            nn.Linear(width, 10),
        )

    def forward(self, x):
        return self.linear_relu_stack(self.flatten(x))


def get_dataloaders(batch_size: int, seed: int = 0) -> tuple[DataLoader, DataLoader]:
    data = np.load(DATA)
    images = torch.tensor(data["images"], dtype=torch.float32) / 16.0
    labels = torch.tensor(data["labels"], dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * 0.8)
    train, test = order[:cut], order[cut:]
    train_loader = DataLoader(TensorDataset(images[train], labels[train]), batch_size=batch_size, shuffle=True)
    test_loader = DataLoader(TensorDataset(images[test], labels[test]), batch_size=batch_size)
    return train_loader, test_loader


def train_func_per_worker(config: dict) -> None:
    lr, epochs = config.get("lr", 1e-3), config.get("epochs", 10)
    batch_size = config.get("batch_size_per_worker", 32)
    report_every = config.get("report_every", 5)
    pace = config.get("pace_seconds", 0.0)
    torch.manual_seed(config.get("seed", 0))

    train_loader, test_loader = get_dataloaders(batch_size, config.get("seed", 0))
    # [1] Ray Train's own data and model preparation: DistributedSampler, DDP, the device.
    train_loader = ray.train.torch.prepare_data_loader(train_loader)
    test_loader = ray.train.torch.prepare_data_loader(test_loader)
    model = ray.train.torch.prepare_model(NeuralNetwork(config.get("width", 512)))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    # [2] Resume from the run's newest checkpoint, if there is one.
    world_rank = ray.train.get_context().get_world_rank()
    start_epoch, skip_batches = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            saved = torch.load(os.path.join(folder, "checkpoint.pt"), weights_only=False)
        model.module.load_state_dict(saved["model"]) if hasattr(model, "module") else model.load_state_dict(
            saved["model"]
        )
        optimizer.load_state_dict(saved["optimizer"])
        start_epoch, skip_batches = saved["epoch"], saved["next_batch"]

    for epoch in range(start_epoch, epochs):
        if ray.train.get_context().get_world_size() > 1:
            train_loader.sampler.set_epoch(epoch)  # the same shuffle on every attempt: a resume is exact
        model.train()
        losses: list[float] = []
        batches = len(train_loader)
        for index, (images, labels) in enumerate(train_loader):
            if epoch == start_epoch and index < skip_batches:
                continue  # trained before the checkpoint this attempt resumed from
            loss = loss_fn(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            last = index + 1 == batches
            if (index + 1) % report_every and not last:
                continue
            metrics = {"epoch": epoch, "loss": float(np.mean(losses))}
            losses = []
            if last:
                metrics["accuracy"] = evaluate(model, test_loader)
            # [3] A checkpoint at each epoch's end, and whenever elastic asks (a reclaim notice is near).
            time.sleep(pace)  # config pace_seconds: a demo's reclaim lands mid-run even on a fast machine
            if not (last or elastic.train.checkpoint_requested()):
                ray.train.report(metrics)
                continue
            position = (epoch + 1, 0) if last else (epoch, index + 1)
            with tempfile.TemporaryDirectory() as folder:
                checkpoint = None
                if world_rank == 0:  # as in Ray's examples: rank 0 saves, every rank reports
                    state = model.module.state_dict() if hasattr(model, "module") else model.state_dict()
                    torch.save(
                        {
                            "model": state,
                            "optimizer": optimizer.state_dict(),
                            "epoch": position[0],
                            "next_batch": position[1],
                        },
                        os.path.join(folder, "checkpoint.pt"),
                    )
                    checkpoint = ray.train.Checkpoint.from_directory(folder)
                ray.train.report(metrics, checkpoint=checkpoint)


def evaluate(model: nn.Module, test_loader: DataLoader) -> float:
    """Held-out accuracy over every rank's share of the test set."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in test_loader:
            correct += (model(images).argmax(1) == labels).sum().item()
            total += len(labels)
    model.train()
    counts = torch.tensor([correct, total], dtype=torch.float64)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts)
    return float(counts[0] / counts[1])
