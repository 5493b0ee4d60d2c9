"""The digits job's model, optimizer and batch, trained through the streaming path (StreamingDataset, the
session's sampler and loader, the job's transform) from its training split stored **sorted by label** and from
the same rows stored pre-shuffled: the block shuffle (row groups permuted, rows mixed within windows of 64
row groups) reaches the held-out accuracy of the unsorted store. One process with the job's global batch (2
workers x 32); no Ray: the order, not the cluster, is under test. One seed's accuracy moves by about a point
with the order alone (360 held-out images), so the means over three seeds are compared."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from elastic.data import ResumableLoader, ResumableSampler, StreamingDataset
from elastic.data.prepare import prepare
from jobs.digits_ddp import DigitsNet, load_digits
from jobs.digits_stream import to_tensors

SEEDS = (0, 1, 2)
EPOCHS = 12  # jobs/digits_stream.yaml's


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    folder = tmp_path_factory.mktemp("digits-stores")
    train_set, test_set = load_digits(seed=0)
    images, labels = train_set.tensors
    order = torch.argsort(labels, stable=True)
    np.savez(folder / "sorted.npz", image=images[order].numpy(), label=labels[order].numpy())
    # The job's layout: ~100 row groups of ~14 rows; sorted, each row group holds one digit.
    prepare(str(folder / "sorted.npz"), str(folder / "sorted"), shard_mb=0.1, row_group_mb=0.004)
    prepare(str(folder / "sorted.npz"), str(folder / "unsorted"), shard_mb=0.1, row_group_mb=0.004, shuffle_seed=7)
    return str(folder / "sorted"), str(folder / "unsorted"), test_set


def held_out_accuracy(uri: str, test_set, seed: int) -> float:
    torch.manual_seed(seed)
    dataset = StreamingDataset(uri, transform=to_tensors, shuffle_window=64)
    model = DigitsNet(32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = ResumableLoader(dataset, ResumableSampler(len(dataset), 64, 0, 1, seed=seed, order_source=dataset))
    for _, (x, y) in loader.epochs(EPOCHS):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    x, y = test_set.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def test_the_label_sorted_store_trains_to_the_accuracy_of_an_unsorted_one(stores):
    sorted_uri, unsorted_uri, test_set = stores
    labels = [int(row["label"]) for row in StreamingDataset(sorted_uri, columns=["label"]).__getitems__(range(1149))]
    assert labels == sorted(labels)  # the hard case really is sorted
    sorted_scores = [held_out_accuracy(sorted_uri, test_set, seed) for seed in SEEDS]
    unsorted_scores = [held_out_accuracy(unsorted_uri, test_set, seed) for seed in SEEDS]
    assert min(sorted_scores + unsorted_scores) >= 0.95, (sorted_scores, unsorted_scores)
    gap = abs(np.mean(sorted_scores) - np.mean(unsorted_scores))
    assert gap <= 0.01, (sorted_scores, unsorted_scores)
