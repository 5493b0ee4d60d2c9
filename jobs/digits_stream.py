"""The digits CNN (jobs/digits_ddp.py) trained from a dataset in the bucket, streamed row group by row group:
`s3://elastic/datasets/digits-sorted`, the training split stored **sorted by label** (the hardest order for a
block shuffle: each row group holds one digit). The session's loader takes its order from the dataset (row
groups permuted, rows shuffled within windows of `shuffle_window` row groups), so a batch mixes digits from
all over the dataset and the run reaches the accuracy of the in-memory job.

The dataset is written on first use (rank 0 runs `elastic data prepare`'s library call; the other ranks wait):
`elastic data inspect s3://elastic/datasets/digits-sorted` shows it afterwards.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from elastic.data import StreamingDataset
from elastic.data.manifest import DatasetError, load
from elastic.data.prepare import prepare
from jobs.digits_ddp import DigitsNet, accuracy, load_digits


def ensure_dataset(session, uri: str, seed: int) -> None:
    """Rank 0 writes the label-sorted training split to `uri` unless it is there; every rank waits for it."""
    if session.rank == 0:
        try:
            load(uri, build=False)
        except DatasetError:
            train_set, _ = load_digits(seed=seed)
            images, labels = train_set.tensors
            order = torch.argsort(labels, stable=True)
            with tempfile.TemporaryDirectory() as folder:
                source = Path(folder) / "digits-sorted.npz"
                np.savez(source, image=images[order].numpy(), label=labels[order].numpy())
                # ~14 rows of 64 floats a row group: ~100 row groups, each one digit.
                prepare(str(source), uri, shard_mb=0.1, row_group_mb=0.004)
            session.log(f"wrote the label-sorted training split to {uri}")
    session.all_reduce_sum(0.0)  # a barrier: the other ranks read the dataset once rank 0 committed it


def to_tensors(row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.as_tensor(np.array(row["image"], dtype=np.float32)).view(1, 8, 8), torch.tensor(int(row["label"]))


def train(session) -> None:
    cfg = session.config
    seed = cfg.get("seed", 0)
    torch.manual_seed(seed)
    uri = cfg.get("dataset", "s3://elastic/datasets/digits-sorted")
    ensure_dataset(session, uri, seed)
    train_set = StreamingDataset(uri, transform=to_tensors, shuffle_window=cfg.get("shuffle_window", 64))
    _, test_set = load_digits(seed=seed)
    model = DigitsNet(cfg.get("width", 32))
    model, optimizer = session.prepare(model, torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05), momentum=0.9))
    loader = session.loader(train_set, batch_size=cfg.get("batch_size", 32), seed=seed)
    session.restore()

    epochs, score, last_epoch = cfg.get("epochs", 10), 0.0, loader.epoch
    total, count = 0.0, 0
    for epoch, (x, y) in loader.epochs(epochs):
        if epoch != last_epoch:
            score = accuracy(session, model, test_set)
            session.log(f"epoch {last_epoch} step {session.step_count} held-out accuracy {score:.4f}")
            last_epoch, total, count = epoch, 0.0, 0
        loss = F.cross_entropy(model(x.to(session.device)), y.to(session.device), reduction="sum") / max(len(y), 1)
        total, count = total + loss.item(), count + 1
        session.optimize(loss, {"epoch": epoch, "loss": loss.item(), "mean_loss": total / count})

    score = accuracy(session, model, test_set)
    session.log(f"epoch {epochs - 1} step {session.step_count} held-out accuracy {score:.4f}")
    session.finish({"epoch": epochs - 1, "accuracy": score, "mean_loss": total / count if count else float("nan")})
