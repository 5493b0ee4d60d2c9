"""A Hugging Face `Trainer` on a tiny GPT-2 built from a `GPT2Config` (nothing downloaded), trained on the Apache
License text in jobs/data as bytes, run by elastic with `api: transformers`. The function is what an HF user
writes: it builds the model, the dataset, `TrainingArguments` and the `Trainer`, and returns the Trainer.
elastic calls `train()` with a callback that commits each Trainer checkpoint to the run folder, saves at a
reclaim notice, and resumes a restarted run from the newest checkpoint.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

TEXT = Path(__file__).parent / "data" / "apache-2.0.txt"


class ByteWindows(Dataset):
    """Fixed-length windows of the text's bytes (a 256-token vocabulary): input_ids, and labels = input_ids
    (GPT2LMHeadModel shifts them itself)."""

    def __init__(self, length: int):
        data = torch.tensor(list(TEXT.read_bytes()), dtype=torch.long)
        self.windows = data[: len(data) // length * length].view(-1, length)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict:
        ids = self.windows[index]
        return {"input_ids": ids, "labels": ids}


class Pace(TrainerCallback):
    """config pace_seconds: a pause after each step, so a demo's reclaim lands mid-run even on a fast machine."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def build_trainer(config: dict) -> Trainer:
    length = config.get("length", 64)
    set_seed(config.get("seed", 0))  # as HF's example scripts do: the same initial weights every time
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=256,
            n_positions=length,
            n_embd=config.get("width", 64),
            n_layer=config.get("layers", 2),
            n_head=config.get("heads", 2),
            resid_pdrop=config.get("dropout", 0.1),
            embd_pdrop=config.get("dropout", 0.1),
            attn_pdrop=config.get("dropout", 0.1),
        )
    )
    args = TrainingArguments(
        # Scratch on this worker's disk: elastic uploads each checkpoint to the run folder and downloads the
        # newest to resume, so nothing here needs to outlive the worker.
        output_dir=config.get("output_dir") or tempfile.mkdtemp(prefix="hf-gpt2-"),
        max_steps=config.get("max_steps", 120),
        per_device_train_batch_size=config.get("batch_size", 8),
        learning_rate=config.get("lr", 3e-3),
        warmup_steps=10,
        lr_scheduler_type="cosine",
        weight_decay=0.01,
        logging_steps=5,
        save_steps=config.get("save_steps", 40),
        save_total_limit=2,
        seed=config.get("seed", 0),
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available(),
    )
    pace = config.get("pace_seconds", 0.0)
    callbacks = [Pace(pace)] if pace else []
    return Trainer(model=model, args=args, train_dataset=ByteWindows(length), callbacks=callbacks)
