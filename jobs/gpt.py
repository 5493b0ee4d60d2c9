"""A GPT-style decoder (pre-norm blocks of causal self-attention and a GELU MLP, tied embeddings), written with
torch.nn alone, for `train.parallelism: fsdp`: each block is an FSDP unit (session.prepare's default: the entries
of the model's ModuleList), bf16 through FSDP's mixed precision, activation checkpointing on the blocks.

`config.size` names a shape: `tiny` trains on a CPU in seconds (CI, the local stack); 125m, 1.3b and 7b are the
GPT-2/3-like shapes for GPUs, each with the memory its training state needs (`memory_estimate`, logged at start).
It trains on the character windows of the charlm job's corpus (in-repo, no download), streamed from the bucket
when `config.dataset` is set.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from elastic.parallel.memory import estimate
from jobs.charlm import CORPUS, CharWindows, tokenized_windows, warmup_cosine

# width, layers, heads: GPT-2 small, GPT-3 XL and LLaMA-7B-like shapes, and a tiny one for CPUs.
SIZES = {
    "tiny": (64, 2, 4),
    "125m": (768, 12, 12),
    "1.3b": (2048, 24, 16),
    "7b": (4096, 32, 32),
}
GPU_VOCAB = 50_304  # the larger sizes are counted with a GPT-2 tokenizer's vocabulary, padded


def parameters_of(size: str, vocab: int = GPU_VOCAB, length: int = 2048) -> int:
    """Parameters of a named size: 12 * width^2 a block, plus the (tied) embedding and positions."""
    width, layers, _ = SIZES[size]
    return layers * (12 * width * width + 13 * width) + vocab * width + length * width + 2 * width


def memory_estimate(size: str, parallelism: str, world_size: int) -> str:
    state = estimate(parameters_of(size), parallelism, world_size, optimizer_slots=2)
    count = parameters_of(size)
    shown = f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    return f"{size}: {shown} parameters with AdamW, {parallelism} at world size {world_size}: {state.describe()}"


def planned_model(config: dict) -> dict:
    """What `elastic submit` checks against the GPUs the workers get (refusing a run that cannot fit)."""
    return {"parameters": parameters_of(config.get("size", "tiny")), "optimizer": "AdamW"}


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # Explicit sizes: a rank may get an empty tail batch, and still runs forward (FSDP's gathers are collective).
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.drop(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, length: int, width: int, layers: int, heads: int, dropout: float):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(length, width))
        self.blocks = nn.ModuleList([Block(width, heads, dropout) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(dropout)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(tokens) + self.position[: tokens.shape[1]])
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()  # tied: the embedding is also the output layer


def train(session) -> None:
    cfg = session.config
    torch.manual_seed(cfg.get("seed", 0))
    size = cfg.get("size", "tiny")
    width, layers, heads = SIZES[size]
    session.log(memory_estimate(size, session.spec.train.parallelism, session.world_size))
    data = CharWindows(CORPUS.read_text(), cfg.get("length", 64), cfg.get("stride", 16))
    vocab = len(data.vocab)
    if cfg.get("dataset"):
        data = tokenized_windows(session, data, f"{cfg['dataset']}-{data.length}-{data.stride}")
    model = GPT(vocab, cfg.get("length", 64), width, layers, heads, cfg.get("dropout", 0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", 3e-3), weight_decay=0.1)
    epochs, batch = cfg.get("epochs", 2), cfg.get("batch_size", 8)
    steps = epochs * math.ceil(len(data) / (batch * session.world_size))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(cfg.get("warmup", 10), steps))
    model, optimizer = session.prepare(model, optimizer, scheduler, checkpoint_layers=(Block,), shard=(Block,))
    loader = session.loader(data, batch_size=batch, seed=cfg.get("seed", 0))
    session.restore()

    loss = torch.tensor(float("nan"))
    for epoch, (x, y) in loader.epochs(epochs):
        logits = model(x.to(session.device))
        loss = F.cross_entropy(logits.flatten(0, 1), y.to(session.device).flatten(), reduction="sum") / max(
            y.numel(), 1
        )
        session.optimize(loss, {"epoch": epoch, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]})
    session.finish({"loss": loss.item()})
