"""A job with a classic resume bug, for verify-resume to catch: its LR scheduler is not registered with the
session (neither passed to prepare() nor tracked), so after a restart the learning rate starts over."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def train(session) -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 16)
    y = (x[:, :4].sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=0.2))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7)  # the bug: not tracked
    loader = session.loader(TensorDataset(x, y), batch_size=16)
    session.restore()
    for epoch, (xb, yb) in loader.epochs(session.config.get("epochs", 2)):
        loss = F.cross_entropy(model(xb), yb)
        session.optimize(loss, {"epoch": epoch, "loss": loss.item()})
        scheduler.step()
    session.finish({"loss": loss.item()})
