"""Handwritten digits (8x8, 1,797 images, the UCI set that scikit-learn ships) with a small CNN under DDP.

The data lives in jobs/data/digits.npz, so nothing is downloaded at run time. Two CPU workers reach >= 95%
held-out accuracy in about a minute including start-up on a 2-core machine. The whole loop is plain PyTorch;
the session checkpoints model, optimizer, data position and RNG, and resumes them at any worker count.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

DATA = Path(__file__).parent / "data" / "digits.npz"


class DigitsNet(nn.Module):
    def __init__(self, width: int = 32):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.head = nn.Linear(2 * width * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def load_digits(holdout: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    data = np.load(DATA)
    images = torch.tensor(data["images"], dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(data["labels"], dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - holdout))
    train, test = order[:cut], order[cut:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def accuracy(session, model: nn.Module, dataset: TensorDataset) -> float:
    """Accuracy over the whole held-out set, each rank scoring every world_size-th sample."""
    x, y = dataset.tensors
    mine = torch.arange(session.rank, len(y), session.world_size)
    model.eval()
    with torch.no_grad():
        correct = (model(x[mine].to(session.device)).argmax(1).cpu() == y[mine]).sum().item()
    model.train()
    correct, seen = session.all_reduce_sum(correct, len(mine))
    return correct / seen


def train(session) -> None:
    cfg = session.config
    torch.manual_seed(cfg.get("seed", 0))
    train_set, test_set = load_digits(seed=cfg.get("seed", 0))
    model = DigitsNet(cfg.get("width", 32))
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05), momentum=0.9))
    loader = session.loader(train_set, batch_size=cfg.get("batch_size", 32), seed=cfg.get("seed", 0))
    session.restore()

    epochs, score, last_epoch = cfg.get("epochs", 10), 0.0, loader.epoch
    total, count = 0.0, 0  # this epoch's mean loss so far (on this rank): a steadier metric than one batch's
    for epoch, (x, y) in loader.epochs(epochs):
        if epoch != last_epoch:  # an epoch just ended
            score = accuracy(session, model, test_set)
            session.log(f"epoch {last_epoch} step {session.step_count} held-out accuracy {score:.4f}")
            last_epoch, total, count = epoch, 0.0, 0
        logits = model(x.to(session.device))
        # sum / batch keeps an empty tail batch (possible at some world sizes) from producing NaN
        loss = F.cross_entropy(logits, y.to(session.device), reduction="sum") / max(len(y), 1)
        # backward, optimizer step (precision, accumulation, NaN guard from the spec's `train:`), checkpoints
        total, count = total + loss.item(), count + 1
        lr = optimizer.param_groups[0]["lr"]  # reported: a sweep's PBT mutates it
        session.optimize(loss, {"epoch": epoch, "loss": loss.item(), "mean_loss": total / count, "lr": lr})

    score = accuracy(session, model, test_set)
    session.log(f"epoch {epochs - 1} step {session.step_count} held-out accuracy {score:.4f}")
    session.finish({"epoch": epochs - 1, "accuracy": score, "mean_loss": total / count if count else float("nan")})
