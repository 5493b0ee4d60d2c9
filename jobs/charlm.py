"""A character-level transformer language model, written as any PyTorch user writes one: dropout 0.1, AdamW,
a warmup + cosine LambdaLR, label smoothing. It draws random numbers at every step (dropout), so resuming it
bit-exactly needs the random streams to continue exactly too; `elastic verify-resume jobs/charlm.yaml` proves
they do.

The corpus is the Apache License 2.0 (jobs/data/apache-2.0.txt, 11 KB), so nothing is downloaded at run time.
With `config.dataset` (jobs/charlm.yaml sets it), the tokenized windows are a dataset in the bucket, written on
first use and streamed by elastic.data.StreamingDataset; without it they are held in memory.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset

from elastic.data import StreamingDataset
from elastic.data.manifest import DatasetError, load
from elastic.data.prepare import prepare

CORPUS = Path(__file__).parent / "data" / "apache-2.0.txt"


class CharWindows(Dataset):
    """Overlapping windows of the corpus: (input, next-character target), `stride` characters apart."""

    def __init__(self, text: str, length: int, stride: int):
        self.vocab = sorted(set(text))
        self.codes = torch.tensor([self.vocab.index(c) for c in text], dtype=torch.long)
        self.length, self.stride = length, stride

    def __len__(self) -> int:
        return (len(self.codes) - self.length - 1) // self.stride

    def __getitem__(self, index: int):
        start = index * self.stride
        window = self.codes[start : start + self.length + 1]
        return window[:-1], window[1:]


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.drop(self.embed(x) + self.position[:n])
        h = self.blocks(h, mask=self.causal[:n, :n], is_causal=True)
        return self.head(self.norm(h))


def tokenized_windows(session, data: CharWindows, uri: str) -> StreamingDataset:
    """The corpus's windows as a dataset in the bucket (a row: the window's length + 1 character codes),
    written by rank 0 on first use; the other ranks wait for its manifest."""
    if session.rank == 0:
        try:
            load(uri, build=False)
        except DatasetError:
            rows = np.stack([_window(data, i) for i in range(len(data))])
            with tempfile.TemporaryDirectory() as folder:
                np.save(f"{folder}/windows.npy", rows)
                prepare(f"{folder}/windows.npy", uri, shard_mb=0.1, row_group_mb=0.01)
            session.log(f"wrote {len(rows)} tokenized windows to {uri}")
    session.all_reduce_sum(0.0)  # a barrier: read once rank 0 committed it
    return StreamingDataset(uri, transform=_split, shuffle_window=8)


def _window(data: CharWindows, index: int) -> np.ndarray:
    start = index * data.stride
    return data.codes[start : start + data.length + 1].numpy()


def _split(row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.as_tensor(row["x"], dtype=torch.long)
    return window[:-1], window[1:]


def warmup_cosine(warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def train(session) -> None:
    cfg = session.config
    torch.manual_seed(cfg.get("seed", 0))
    data = CharWindows(CORPUS.read_text(), cfg.get("length", 64), cfg.get("stride", 16))
    vocab = len(data.vocab)
    if cfg.get("dataset"):  # one dataset per window shape: <dataset>-<length>-<stride>
        data = tokenized_windows(session, data, f"{cfg['dataset']}-{data.length}-{data.stride}")
    model = CharTransformer(
        vocab,
        cfg.get("length", 64),
        cfg.get("width", 64),
        cfg.get("layers", 2),
        cfg.get("heads", 4),
        cfg.get("dropout", 0.1),
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 3e-3), weight_decay=0.1)
    epochs, batch = cfg.get("epochs", 3), cfg.get("batch_size", 8)
    steps = epochs * math.ceil(len(data) / (batch * session.world_size))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.get("warmup", 10), steps))
    model, optimizer = session.prepare(model, optimizer, scheduler)
    loader = session.loader(data, batch_size=batch, seed=cfg.get("seed", 0))
    session.restore()

    loss = torch.tensor(float("nan"))
    for epoch, (x, y) in loader.epochs(epochs):
        logits = model(x.to(session.device))
        # sum / batch keeps an empty tail batch (possible at some world sizes) from producing NaN
        loss = F.cross_entropy(
            logits.flatten(0, 1), y.to(session.device).flatten(), label_smoothing=0.1, reduction="sum"
        ) / max(y.numel(), 1)
        session.optimize(loss, {"epoch": epoch, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]})
    session.finish({"loss": loss.item()})
