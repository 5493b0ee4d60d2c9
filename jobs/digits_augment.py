"""The digits CNN (jobs/digits_ddp.py) trained with random augmentation in two DataLoader worker processes:
each image is shifted by a random crop of its padded copy (torch's generator), sometimes mirrored (python's
`random`) and given a little noise (numpy's). The session's loader seeds every worker's generators per sample
from (seed, epoch, index), so `elastic verify-resume jobs/digits_augment.yaml` finds the resumed run
bit-identical to an uninterrupted one.
"""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from jobs.digits_ddp import DigitsNet, accuracy, load_digits


class RandomShiftFlipNoise(Dataset):
    """Augments each 1x8x8 image: a random 8x8 crop of it padded by `pad`, a mirror with probability
    `flip`, and Gaussian noise of std `noise`."""

    def __init__(self, data: TensorDataset, pad: int = 1, flip: float = 0.2, noise: float = 0.05):
        self.data, self.pad, self.flip, self.noise = data, pad, flip, noise

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        image, label = self.data[index]
        padded = F.pad(image, (self.pad,) * 4)
        top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        image = padded[:, top : top + 8, left : left + 8]
        if random.random() < self.flip:
            image = image.flip(-1)
        image = image + torch.from_numpy(np.random.normal(0.0, self.noise, image.shape).astype(np.float32))
        return image, label


def train(session) -> None:
    cfg = session.config
    torch.manual_seed(cfg.get("seed", 0))
    train_set, test_set = load_digits(seed=cfg.get("seed", 0))
    model = DigitsNet(cfg.get("width", 16))
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05), momentum=0.9))
    # Persistent workers: forked once, not at every epoch (a fork of a Ray worker costs a second here).
    loader = session.loader(
        RandomShiftFlipNoise(train_set),
        batch_size=cfg.get("batch_size", 32),
        seed=cfg.get("seed", 0),
        num_workers=cfg.get("loader_workers", 2),
        persistent_workers=cfg.get("loader_workers", 2) > 0,
    )
    session.restore()

    epochs = cfg.get("epochs", 3)
    loss = torch.tensor(float("nan"))
    for epoch, (x, y) in loader.epochs(epochs):
        logits = model(x.to(session.device))
        loss = F.cross_entropy(logits, y.to(session.device), reduction="sum") / max(len(y), 1)
        session.optimize(loss, {"epoch": epoch, "loss": loss.item()})
    score = accuracy(session, model, test_set)
    session.log(f"step {session.step_count} held-out accuracy {score:.4f}")
    session.finish({"accuracy": score, "loss": loss.item()})
