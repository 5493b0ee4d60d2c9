"""`train_vs_memory` of `elastic bench data`: a small DDP loop fed from the bucket beside the same loop fed from
memory, in one run.

Both sides train the same model (an MLP over the dataset's `payload` column, its `label` as the class) with
DDP over gloo, one process per rank, on the same global batches in the same order: from the bucket through
StreamingDataset and the session's ResumableLoader (the path a job takes, with the next window prefetched),
and from the same rows held in memory as tensors, indexed by the same sampler. The ratio is the bucket loop's
rows/s over the memory loop's: 1.0 means the loop never waited on the data path.

The floor (elastic.bench.data_floor): the memory loop again, with the row groups its steps use fetched and
decoded beside it, once between the node's ranks: the loop's pace when the bytes it needs must cross these
same cores (on a small machine, shared with the S3 server). `train_vs_floor` is the bucket loop against it.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

from elastic.bench.checkpointing import _free_port
from elastic.data.cache import CACHE_DIR_VARIABLE


def bench_training(uri: str, ranks: int = 2, batch_size: int = 256, hidden: int = 1024, max_steps: int = 200) -> dict:
    """Rows/s of both loops over at most `max_steps` global steps of one epoch, and their ratio."""
    import torch.multiprocessing as mp

    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "FSSPEC_"))}
    with tempfile.TemporaryDirectory() as tmp:
        env[CACHE_DIR_VARIABLE] = f"{tmp}/cache"  # a fresh node cache: nothing of an earlier run is reused
        out = f"{tmp}/result.json"
        mp.spawn(
            _training_rank,
            args=(ranks, _free_port(), uri, batch_size, hidden, max_steps, out, env),
            nprocs=ranks,
            join=True,
        )
        raw = json.loads(Path(out).read_text())
    return {
        "train_ranks": ranks,
        "train_rows": raw["rows"],
        "train_bucket_rows_per_s": round(raw["rows"] / raw["bucket_s"]),
        "train_memory_rows_per_s": round(raw["rows"] / raw["memory_s"]),
        "train_data_wait_share": round(raw["bucket_wait_s"] / raw["bucket_s"], 3),
        "train_vs_memory": round(raw["memory_s"] / raw["bucket_s"], 3),
        "train_floor_rows_per_s": round(raw["rows"] / raw["floor_s"]),
        "train_floor_vs_memory": round(raw["memory_s"] / raw["floor_s"], 3),
        "train_vs_floor": round(raw["floor_s"] / raw["bucket_s"], 3),
    }


def _training_rank(
    rank: int, world: int, port: int, uri: str, batch_size: int, hidden: int, max_steps: int, out: str, env: dict
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    from elastic.bench import data_floor
    from elastic.data import ResumableLoader, ResumableSampler, StreamingDataset

    torch.set_num_threads(1)  # one core a rank: the machine's cores are the ranks'
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dataset = StreamingDataset(uri, columns=["payload", "label"], verify=False)
    width = dataset.manifest.arrow_schema().field("payload").type.list_size
    steps = min(max_steps, -(-len(dataset) // (batch_size * world)))

    def sampler() -> ResumableSampler:
        return ResumableSampler(len(dataset), batch_size, rank, world, seed=0, order_source=dataset)

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(width, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10),
        )
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)

    def train(batches) -> float:
        model, optimizer = model_and_optimizer()
        dist.barrier()
        started = time.perf_counter()
        for _, (x, y) in zip(range(steps), batches):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        dist.barrier()
        return time.perf_counter() - started

    # The memory side's rows: this rank's rows of those steps, read ahead of the clock, indexed by the same order.
    memory_sampler = sampler()
    indices = [batch for _, batch in zip(range(steps), memory_sampler.pending())]
    wanted = sorted({i for batch in indices for i in batch})
    rows = dataset.__getitems__(wanted)
    slot = {index: k for k, index in enumerate(wanted)}
    x_all = torch.as_tensor(rows.columns["payload"])
    y_all = torch.as_tensor(rows.columns["label"])

    def memory_batches():
        return ((x_all[[slot[i] for i in b]], y_all[[slot[i] for i in b]]) for b in indices)

    memory_s = train(memory_batches())

    # The floor: the row groups of every rank's steps, this rank's share of them fetched and decoded beside it.
    every_rank = [
        i
        for r in range(world)
        for _, batch in zip(range(steps), ResumableSampler(len(dataset), batch_size, r, world, seed=0,
                                                           order_source=dataset).pending())
        for i in batch
    ]  # fmt: skip
    groups = data_floor.groups_of_rows(dataset.manifest, every_rank)[rank::world]
    floor_s, _ = data_floor.beside(lambda: train(memory_batches()), uri, dataset.manifest, groups, ["payload", "label"])

    # Nothing fetched yet; the ranks of this node share the node cache, as a job's would with cache_limit set.
    fresh = StreamingDataset(uri, columns=["payload", "label"], verify=False, cache_limit="64GB")
    loader = ResumableLoader(fresh, ResumableSampler(len(fresh), batch_size, rank, world, seed=0, order_source=fresh))
    bucket_batches = ((batch["payload"], batch["label"]) for batch in loader)
    bucket_s = train(bucket_batches)
    times = torch.tensor([memory_s, bucket_s, loader.take_wait_seconds(), floor_s], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if rank == 0:
        result = {
            "rows": steps * batch_size * world,
            "memory_s": times[0].item(),
            "bucket_s": times[1].item(),
            "bucket_wait_s": times[2].item(),
            "floor_s": times[3].item(),
        }
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()
