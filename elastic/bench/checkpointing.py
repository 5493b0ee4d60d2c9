"""`elastic bench checkpoint`: W local ranks (gloo) save a DDP-like replicated state of N MB with our sharded
checkpointer, and put/get the same bytes with plain parallel multipart requests (the limit the storage allows).
Reports save and load throughput against raw put and get, and the async save's blocking time against a sync
save. In the same run, torch's own path saves and loads the same state: DCP's FsspecWriter/FsspecReader (through
s3fs, same endpoint and credentials, as many writer threads as ours) and dcp.async_save with that writer; its
figures sit beside ours (`torch_*`; `save_vs_torch` > 1: ours is faster).

With `parallelism="fsdp"` the model is sharded with FSDP2 (elastic.parallel.fsdp, as session.prepare does): each
rank saves and loads its own shards, the raw baseline puts and gets each rank's share, and `bytes_per_rank_ratio`
is the most bytes any rank wrote over the checkpoint's total (1/W when the state is evenly sharded)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from elastic.checkpoint.checkpointer import ShardedCheckpointer
from elastic.checkpoint.store import CheckpointStore
from elastic.parallel.fsdp import local
from elastic.storage import check_storage

MB = 1024 * 1024


@dataclass
class CheckpointBench:
    uri: str
    size_mb: float
    workers: int
    raw_put_mb_s: float
    save_mb_s: float
    raw_get_mb_s: float
    load_mb_s: float
    sync_save_s: float
    async_blocked_s: float
    throughput_ratio: float  # save / raw put: the median of the repeats' paired ratios
    load_ratio: float  # load / raw get: likewise
    stall_ratio: float  # async blocking time / sync save time
    shards: int
    loaded_equal: bool
    repeats: int
    throughput_ratios: list[float]  # each repeat's, in order: the spread shows the endpoint's noise
    load_ratios: list[float]
    # torch's own path, same state, same run: DCP's FsspecWriter/FsspecReader and dcp.async_save
    torch_save_mb_s: float
    torch_load_mb_s: float
    torch_sync_save_s: float
    torch_async_blocked_s: float
    torch_fsspec_throughput_ratio: float  # torch save / raw put: the median of the paired ratios
    torch_fsspec_load_ratio: float  # torch load / raw get: likewise
    torch_async_save_stall_ratio: float  # torch's async blocking time / torch's sync save time
    save_vs_torch: float  # torch save time / our save time, paired median: > 1 means ours is faster
    load_vs_torch: float  # torch load time / our load time: likewise
    async_blocked_vs_torch: float  # torch's async blocking time / ours, paired median: > 1 means ours blocks less
    parallelism: str = "ddp"
    bytes_per_rank_ratio: float = 1.0  # the most bytes any rank wrote / the checkpoint's bytes


def bench_model(size_mb: float, width: int = 1024, seed: int = 0):
    """An MLP and AdamW whose state (weights and both moments) is about `size_mb`, identical on every rank
    (replicated, as under DDP), after one optimizer step so the moments exist."""
    import torch
    import torch.nn as nn

    torch.manual_seed(seed)
    layers = max(1, round(size_mb * MB / 3 / 4 / (width * width + width)))
    model = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, optimizer


def train_step(model, optimizer, batch: int = 16, seed: int = 0) -> None:
    """One real forward/backward/step (the compute an async save's copy overlaps with)."""
    import torch

    width = model[0][0].in_features
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _timed(barrier, action) -> float:
    """Wall time of `action` across all ranks: from a common start to the slowest rank's end."""
    barrier()
    started = time.perf_counter()
    action()
    barrier()
    return time.perf_counter() - started


def _checkpoint_rank(
    rank: int,
    world: int,
    port: int,
    run_uri: str,
    size_mb: float,
    repeats: int,
    out: str,
    env: dict,
    parallelism: str = "ddp",
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    # Private module: torch 2.13 exports no FsspecWriter/Reader from torch.distributed.checkpoint; this is the
    # class dcp.save(checkpoint_id="s3://...") itself picks, built here to pass the endpoint and thread count.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    store = CheckpointStore(run_uri)
    checkpointer = ShardedCheckpointer(store, rank, world, group)
    model, optimizer = bench_model(size_mb)
    if parallelism == "fsdp":
        from elastic.config.spec import FsdpSpec
        from elastic.parallel.fsdp import shard_model

        shard_model(model, optimizer, FsdpSpec(), "fp32")  # each Linear+Tanh a unit; the optimizer rebound
    train_step(model, optimizer)
    optimizer.register_step_pre_hook(lambda *_: checkpointer.wait_staged())

    def state() -> dict:
        model_state, optim_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optim_state}

    def tensors(tree) -> list:
        if isinstance(tree, torch.Tensor):
            return [tree]
        if isinstance(tree, dict):
            return [t for v in tree.values() for t in tensors(v)]
        return []

    storage = lambda tensor: local(tensor).untyped_storage().data_ptr()  # noqa: E731  (a DTensor: its shard)
    live = {storage(p) for p in model.parameters()} | {
        storage(t) for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)
    }
    deferrable = lambda tensor: storage(tensor) in live  # noqa: E731
    # ddp: the whole (replicated) state, of which each rank writes a share; fsdp: this rank's shards.
    payload = torch.cat([local(t).detach().flatten().float() for t in tensors(state())]).numpy().tobytes()
    # The raw baseline: the same bytes, this rank's share, in as many objects at once as our save writes files.
    threads = checkpointer.threads_for(state())
    if parallelism == "fsdp":
        mine = payload
    else:
        share = len(payload) // world
        mine = payload[rank * share : len(payload) if rank == world - 1 else (rank + 1) * share]
    piece = -(-len(mine) // threads)
    raw = f"{store.root}/raw"
    objects = {f"{raw}/part-{rank}-{i}": mine[i * piece : (i + 1) * piece] for i in range(threads)}
    counts = [0] * world
    dist.all_gather_object(counts, (threads, len(mine)))
    every_object = [f"{raw}/part-{r}-{i}" for r in range(world) for i in range(counts[r][0])]
    total_bytes = sum(n for _, n in counts)
    barrier = dist.barrier
    put = lambda: store.fs.pipe(objects)  # noqa: E731  (s3fs sends a batch concurrently)
    # torch's own path: its stock fsspec writer/reader on the same endpoint and credentials, as many threads
    # (files per rank) as ours; everything else at torch's defaults.
    options = store.writer_options()
    torch_uri = lambda step: f"{run_uri}/torch/step-{step}"  # noqa: E731  (with its scheme: store.root has none)
    torch_writer = lambda step: FsspecWriter(torch_uri(step), thread_count=threads, **options)  # noqa: E731
    torch_save = lambda step: dcp.save(state(), storage_writer=torch_writer(step), process_group=group)  # noqa: E731

    # Warm-up, untimed: connections, DCP's planner, staging buffers. Training saves are steady-state too.
    put()
    checkpointer.save(0, state(), asynchronous=False)
    checkpointer.wait()
    torch_save(0)
    times: dict[str, list[float]] = {
        key: [] for key in ("put_s", "save_s", "get_s", "load_s", "blocked_s", "torch_save_s", "torch_load_s")
    }
    times["torch_blocked_s"] = []
    committed, equal = True, True
    for step in range(1, repeats + 1):
        sync_step, async_step = 2 * step - 1, 2 * step
        expected = [t.clone() for t in tensors(state())]
        writes = {
            "put_s": put,
            "save_s": lambda: checkpointer.save(sync_step, state(), asynchronous=False),  # noqa: B023 (run now)
            "torch_save_s": lambda: torch_save(sync_step),  # noqa: B023 (run now)
        }
        # Alternate which goes first: the endpoint may still be busy with what came before.
        for key in list(writes) if step % 2 else list(reversed(writes)):
            times[key].append(_timed(barrier, writes[key]))
        committed &= checkpointer.wait().committed
        # Async, as in training: save, then the next step's forward/backward while parameters and optimizer
        # state are copied; its optimizer.step waits (pre-hook) for the copy. Blocked = save() + that wait.
        barrier()
        checkpointer.save(async_step, state(), asynchronous=True, deferrable=deferrable)
        train_step(model, optimizer, seed=step)
        result = checkpointer.wait()
        committed &= result.committed
        blocked = [0.0] * world
        dist.all_gather_object(blocked, result.blocked_seconds)
        times["blocked_s"].append(max(blocked))
        # torch's async save, alike: blocked = until async_save returns (it stages in memory before returning).
        barrier()
        started = time.perf_counter()
        saving = dcp.async_save(state(), storage_writer=torch_writer(async_step), process_group=group)
        torch_blocked = time.perf_counter() - started
        train_step(model, optimizer, seed=repeats + step)
        saving.result()
        dist.all_gather_object(blocked, torch_blocked)
        times["torch_blocked_s"].append(max(blocked))
        template, torch_template = state(), state()
        for tensor in tensors(template) + tensors(torch_template):
            tensor.zero_()
        torch_reader = FsspecReader(torch_uri(sync_step), **options)
        reads = {
            "get_s": lambda: store.fs.cat(every_object),
            "load_s": lambda: checkpointer.load(sync_step, template),  # noqa: B023 (run now)
            "torch_load_s": lambda: dcp.load(torch_template, storage_reader=torch_reader, process_group=group),  # noqa: B023
        }
        store.fs.invalidate_cache(raw)
        for key in list(reads) if step % 2 else list(reversed(reads)):
            times[key].append(_timed(barrier, reads[key]))
        equal &= all(torch.equal(local(a), local(b)) for a, b in zip(tensors(template), expected))
        equal &= all(torch.equal(local(a), local(b)) for a, b in zip(tensors(torch_template), expected))
        barrier()
        if rank == 0:  # untimed: keep the endpoint's memory from growing over the repeats
            store.fs.rm(raw, recursive=True)
            store.fs.invalidate_cache(f"{store.root}/torch")  # torch wrote through its own s3fs instance
            store.fs.rm(f"{store.root}/torch", recursive=True)
            store.delete(async_step)
            if step > 1:
                store.delete(sync_step - 2)
        barrier()

    equal_all = [False] * world
    dist.all_gather_object(equal_all, equal)
    if rank == 0:
        info = store.info(2 * repeats - 1)
        medians = {key: statistics.median(values) for key, values in times.items()}
        by_rank: dict[str, int] = {}
        for name, size in info.files.items():  # DCP names a rank's files __<rank>_<n>.distcp
            if name.endswith(".distcp"):
                rank_of = name.rsplit("/", 1)[-1].split("_")[2]
                by_rank[rank_of] = by_rank.get(rank_of, 0) + size
        Path(out).write_text(
            json.dumps(
                {
                    **medians,
                    "times": times,
                    "committed": committed,
                    "shards": info.shards,
                    "bytes": total_bytes,
                    "equal": all(equal_all),
                    "bytes_per_rank_ratio": max(by_rank.values()) / max(1, sum(by_rank.values())),
                }
            )
        )
        store.fs.invalidate_cache(store.root)
        store.fs.rm(store.root, recursive=True)
    dist.destroy_process_group()


def bench_checkpoint(
    uri: str, size_mb: float = 256, workers: int = 2, repeats: int = 7, parallelism: str = "ddp"
) -> CheckpointBench:
    import torch.multiprocessing as mp

    check_storage(uri)
    run_uri = f"{uri.rstrip('/')}/bench-checkpoint-{time.strftime('%Y%m%d-%H%M%S')}"
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "FSSPEC_"))}
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        mp.spawn(
            _checkpoint_rank,
            args=(workers, _free_port(), run_uri, size_mb, repeats, out, env, parallelism),
            nprocs=workers,
            join=True,
        )
        raw = json.loads(Path(out).read_text())
    if not raw["committed"]:
        raise RuntimeError("a benchmark checkpoint did not commit; see the log above")
    size = raw["bytes"] / MB
    put, save, get, load = (size / raw[k] for k in ("put_s", "save_s", "get_s", "load_s"))
    # Ratios are paired within a repeat (the raw transfer and ours ran back to back, in alternating order), so a
    # slow spell of the endpoint (its garbage collector, the machine's other work) hits both sides of a ratio.
    times = raw["times"]
    throughput = [round(p / s, 3) for p, s in zip(times["put_s"], times["save_s"])]
    loads = [round(g / load, 3) for g, load in zip(times["get_s"], times["load_s"])]
    torch_throughput = [round(p / s, 3) for p, s in zip(times["put_s"], times["torch_save_s"])]
    torch_loads = [round(g / load, 3) for g, load in zip(times["get_s"], times["torch_load_s"])]
    paired = lambda a, b: round(statistics.median(x / y for x, y in zip(times[a], times[b])), 3)  # noqa: E731
    return CheckpointBench(
        uri=uri,
        size_mb=round(size, 1),
        workers=workers,
        raw_put_mb_s=round(put, 1),
        save_mb_s=round(save, 1),
        raw_get_mb_s=round(get, 1),
        load_mb_s=round(load, 1),
        sync_save_s=round(raw["save_s"], 3),
        async_blocked_s=round(raw["blocked_s"], 4),
        throughput_ratio=round(statistics.median(throughput), 3),
        load_ratio=round(statistics.median(loads), 3),
        stall_ratio=round(raw["blocked_s"] / raw["save_s"], 4),
        shards=raw["shards"],
        loaded_equal=raw["equal"],
        repeats=repeats,
        throughput_ratios=throughput,
        load_ratios=loads,
        torch_save_mb_s=round(size / raw["torch_save_s"], 1),
        torch_load_mb_s=round(size / raw["torch_load_s"], 1),
        torch_sync_save_s=round(raw["torch_save_s"], 3),
        torch_async_blocked_s=round(raw["torch_blocked_s"], 4),
        torch_fsspec_throughput_ratio=round(statistics.median(torch_throughput), 3),
        torch_fsspec_load_ratio=round(statistics.median(torch_loads), 3),
        torch_async_save_stall_ratio=round(raw["torch_blocked_s"] / raw["torch_save_s"], 4),
        save_vs_torch=paired("torch_save_s", "save_s"),
        load_vs_torch=paired("torch_load_s", "load_s"),
        async_blocked_vs_torch=paired("torch_blocked_s", "blocked_s"),
        parallelism=parallelism,
        bytes_per_rank_ratio=round(raw["bytes_per_rank_ratio"], 3),
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
