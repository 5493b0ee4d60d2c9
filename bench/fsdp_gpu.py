"""One FSDP2 step on one device, as a GPU check: jobs/gpt.py's decoder sharded with elastic.parallel
(fully_shard on each block and the root, bf16 parameters, fp32 gradient reduction) on an NCCL process group of one
rank, a few AdamW steps, a DCP save of the sharded state and its load into a fresh model, compared exactly.

    .venv/bin/python bench/fsdp_gpu.py            # on a CUDA machine: NCCL, bf16, the 125m size
    DRY=1 .venv/bin/python bench/fsdp_gpu.py      # CPU dry run: gloo, the tiny size

Prints one JSON object (and writes $OUT/fsdp_gpu.json when OUT is set): backend, step time, peak GPU memory, the
state bytes measured from the tensors beside the planner's estimate, and whether the load was exact."""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from elastic.config.spec import FsdpSpec  # noqa: E402
from elastic.parallel.fsdp import shard_model  # noqa: E402
from elastic.parallel.memory import estimate, measured  # noqa: E402
from jobs.gpt import GPT, SIZES, Block, parameters_of  # noqa: E402

log = logging.getLogger("bench.fsdp_gpu")


def build(size: str, vocab: int, length: int, device: torch.device):
    torch.manual_seed(0)
    width, layers, heads = SIZES[size]
    model = GPT(vocab, length, width, layers, heads, dropout=0.0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, line = shard_model(model, optimizer, FsdpSpec(), "bf16", shard=(Block,))
    return model, optimizer, line


def main() -> dict:
    dry = os.environ.get("DRY") == "1"
    cuda = torch.cuda.is_available() and not dry
    if not cuda and not dry:
        raise SystemExit("no CUDA: use DRY=1 on CPU")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    store = Path(tempfile.mkdtemp(prefix="fsdp-gpu-")) / "store"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    size, vocab, length, batch = ("125m", 50_304, 1024, 8) if cuda else ("tiny", 256, 64, 4)
    model, optimizer, line = build(size, vocab, length, device)
    log.info("%s", line)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(1)).to(device)
    times = []
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        loss = loss.detach()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    state = measured(model, optimizer)
    planned = estimate(parameters_of(size, vocab, length), "fsdp", 1)
    folder = tempfile.mkdtemp(prefix="fsdp-gpu-ckpt-")
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    fresh, fresh_optimizer, _ = build(size, vocab, length, device)
    fresh_optimizer.step()  # allocate its moments, to be overwritten by the load
    loaded_model, loaded_optim = get_state_dict(fresh, fresh_optimizer)
    target = {"model": loaded_model, "optim": loaded_optim}
    dcp.load(target, checkpoint_id=folder)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=target["model"], optim_state_dict=target["optim"])
    exact = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    result = {
        "backend": backend,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "size": size,
        "parameters": parameters_of(size, vocab, length),
        "loss": round(loss.item(), 4),
        "step_ms": round(1000 * sorted(times[1:])[len(times[1:]) // 2], 1),  # median, the first step warms up
        "peak_gpu_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        "state_mb_measured": round(state.total / 1e6, 2),
        "state_mb_planned": round(planned.total / 1e6, 2),
        "loaded_exact": exact,
    }
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    outcome = main()
    text = json.dumps(outcome, indent=2)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        (Path(os.environ["OUT"]) / "fsdp_gpu.json").write_text(text)
    sys.stdout.write(text + "\n")
    sys.exit(0 if outcome["loaded_exact"] else 1)
