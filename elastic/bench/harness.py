"""The benchmarks behind `elastic bench`: each measures ours and its baseline side by side, in one run, against
the same endpoint or cluster, and reports ratios (users run them against their own bucket and cluster).

- checkpoint: W local ranks (gloo) save a DDP-like replicated state of N MB with our sharded checkpointer, and
  put/get the same bytes with plain parallel multipart requests (the limit the storage allows). Reports
  save and load throughput against raw put and get, and the async save's blocking time against a sync save.
- overhead: one Ray Train run with W workers trains the same model on the same data through a bare DDP loop
  and through the harness (checkpoints off; then async checkpoints every 20 steps), in short blocks that
  rotate through the variants, so that drift on a shared machine hits every variant alike. Reports step-time
  ratios taken within each round of blocks (median over rounds). A fourth variant, the bare loop plus a raw
  PUT of the same bytes at the same interval, is the floor: what moving the bytes alone costs the training.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from elastic import logs
from elastic.checkpoint.checkpointer import ShardedCheckpointer
from elastic.checkpoint.store import CheckpointStore, run_directory
from elastic.config.spec import JobSpec
from elastic.storage import check_storage, pyarrow_filesystem
from elastic.worker.session import Session

MB = 1024 * 1024
OVERHEAD_RESULT = "bench-overhead.json"

# ---------------------------------------------------------------------------------------------------------
# checkpoint


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
    rank: int, world: int, port: int, run_uri: str, size_mb: float, repeats: int, out: str, env: dict
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    store = CheckpointStore(run_uri)
    checkpointer = ShardedCheckpointer(store, rank, world, group)
    model, optimizer = bench_model(size_mb)
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

    live = {p.untyped_storage().data_ptr() for p in model.parameters()} | {
        t.untyped_storage().data_ptr()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    }
    deferrable = lambda tensor: tensor.untyped_storage().data_ptr() in live  # noqa: E731
    payload = torch.cat([t.flatten().float() for t in tensors(state())]).numpy().tobytes()
    # The raw baseline: the same bytes, this rank's share, in as many objects at once as our save writes files.
    threads = checkpointer.threads_for(state())
    share = len(payload) // world
    mine = payload[rank * share : len(payload) if rank == world - 1 else (rank + 1) * share]
    piece = -(-len(mine) // threads)
    raw = f"{store.root}/raw"
    objects = {f"{raw}/part-{rank}-{i}": mine[i * piece : (i + 1) * piece] for i in range(threads)}
    every_object = [f"{raw}/part-{r}-{i}" for r in range(world) for i in range(threads)]
    barrier = dist.barrier
    put = lambda: store.fs.pipe(objects)  # noqa: E731  (s3fs sends a batch concurrently)

    # Warm-up, untimed: connections, DCP's planner, staging buffers. Training saves are steady-state too.
    put()
    checkpointer.save(0, state(), asynchronous=False)
    checkpointer.wait()
    times: dict[str, list[float]] = {"put_s": [], "save_s": [], "get_s": [], "load_s": [], "blocked_s": []}
    committed, equal = True, True
    for step in range(1, repeats + 1):
        sync_step, async_step = 2 * step - 1, 2 * step
        expected = [t.clone() for t in tensors(state())]
        writes = {"put_s": put, "save_s": lambda: checkpointer.save(sync_step, state(), asynchronous=False)}  # noqa: B023 (run now)
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
        template = state()
        for tensor in tensors(template):
            tensor.zero_()
        reads = {"get_s": lambda: store.fs.cat(every_object), "load_s": lambda: checkpointer.load(sync_step, template)}  # noqa: B023 (run now)
        store.fs.invalidate_cache(raw)
        for key in list(reads) if step % 2 else list(reversed(reads)):
            times[key].append(_timed(barrier, reads[key]))
        equal &= all(torch.equal(a, b) for a, b in zip(tensors(template), expected))
        barrier()
        if rank == 0:  # untimed: keep the endpoint's memory from growing over the repeats
            store.fs.rm(raw, recursive=True)
            store.delete(async_step)
            if step > 1:
                store.delete(sync_step - 2)
        barrier()

    equal_all = [False] * world
    dist.all_gather_object(equal_all, equal)
    if rank == 0:
        info = store.info(2 * repeats - 1)
        medians = {key: statistics.median(values) for key, values in times.items()}
        Path(out).write_text(
            json.dumps(
                {
                    **medians,
                    "times": times,
                    "committed": committed,
                    "shards": info.shards,
                    "bytes": len(payload),
                    "equal": all(equal_all),
                }
            )
        )
        store.fs.rm(store.root, recursive=True)
    dist.destroy_process_group()


def bench_checkpoint(uri: str, size_mb: float = 256, workers: int = 2, repeats: int = 7) -> CheckpointBench:
    import torch.multiprocessing as mp

    check_storage(uri)
    run_uri = f"{uri.rstrip('/')}/bench-checkpoint-{time.strftime('%Y%m%d-%H%M%S')}"
    env = {k: v for k, v in os.environ.items() if k.startswith(("AWS_", "FSSPEC_"))}
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.json"
        mp.spawn(
            _checkpoint_rank,
            args=(workers, _free_port(), run_uri, size_mb, repeats, out, env),
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
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------
# overhead


@dataclass
class OverheadBench:
    workers: int
    rounds: int
    steps_per_block: int
    bare_step_ms: float
    harness_step_ms: float
    harness_ckpt_step_ms: float
    overhead_ratio: float  # harness / bare, checkpoints off
    ckpt_overhead_ratio: float  # harness with async checkpoints every 20 steps / bare
    bare_put_step_ms: float
    put_overhead_ratio: float  # the floor: bare loop + a raw PUT of the same bytes every 20 steps / bare
    checkpoints_committed: int
    checkpoint_every_steps: int
    save_stall_ms: float  # the loop's mean wait per save: staging, and the optimizer step waiting for its copy
    save_ms: float  # mean time from save() to commit, in the background
    block_end_wait_ms: float  # mean wait at a checkpointing block's end for its last save (counted in the block)


def _bench_model(width: int):
    import torch.nn as nn

    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def _overhead_worker(config: dict) -> None:
    """Inside Ray Train: the bare loop and the harness, in short interleaved blocks, on the same model and data.

    A block is `steps` steps (a multiple of the checkpoint interval) of one variant. Blocks rotate through the
    variants many times, so a slow spell of the shared machine (step times drift by 20% over tens of seconds
    here) hits all of them alike. The checkpointing variant runs offset by half an interval: its saves fall
    mid-block, and the block's time includes waiting for its last save, so every save's full cost (its
    staging, its background upload competing for the CPU, its commit) is inside some timed block."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    logs.configure()  # a Ray Train worker process: the session's lines get the same format as a job's
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    width, batch, steps, rounds = config["width"], config["batch"], config["steps"], config["rounds"]
    every = config["every_steps"]
    if steps % every or steps < every:
        raise ValueError(f"steps per block ({steps}) must be a multiple of the checkpoint interval ({every})")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = batch * 4 * steps * world  # epochs of a few blocks: the loaders' epoch turns are timed too
    data = TensorDataset(torch.randn(samples, width), torch.randint(0, 10, (samples,)))

    # The bare baseline: what a user writes with Ray Train and plain PyTorch.
    bare_model = DistributedDataParallel(_bench_model(width))
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
    bare_loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, world, rank, seed=0))

    def bare_step(batch_data) -> None:
        x, y = batch_data
        loss = F.cross_entropy(bare_model(x), y)
        bare_opt.zero_grad()
        loss.backward()
        bare_opt.step()

    def harness(every_steps: int):
        spec = JobSpec.model_validate(
            {**config["spec"], "checkpoint": {**config["spec"]["checkpoint"], "every_steps": every_steps}}
        )
        session = Session(spec, config["run_names"][str(every_steps)])
        model = _bench_model(width)
        model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        loader = session.loader(data, batch_size=batch, seed=0)

        def one_step(batch_data) -> None:
            x, y = batch_data
            session.optimize(F.cross_entropy(model(x), y))

        return session, loader, one_step

    def endless(loader):
        while True:
            yield from loader

    _, quiet_loader, quiet_step = harness(10**9)  # checkpoints off
    saving, saving_loader, saving_step = harness(every)

    # The floor: the bare loop plus a raw PUT of this rank's share of the state's bytes every `every` steps, in
    # a background thread. What moving the bytes alone to this endpoint costs the training on this machine.
    raw_put = {"count": every // 2, "thread": None, "payload": None}
    raw_path = f"{saving.store.root}/raw-put/part-{rank}"

    def wait_raw_put() -> None:
        if raw_put["thread"] is not None:
            raw_put["thread"].join()
            raw_put["thread"] = None

    def bare_put_step(batch_data) -> None:
        bare_step(batch_data)
        raw_put["count"] += 1
        if raw_put["count"] % every == 0:
            wait_raw_put()
            if raw_put["payload"] is None:  # built once, untimed: the floor counts the transfer alone
                state = [p.detach() for p in bare_model.parameters()] + [
                    t for s in bare_opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
                ]
                flat = torch.cat([t.flatten().float() for t in state]).numpy().tobytes()
                share = len(flat) // world
                raw_put["payload"] = flat[rank * share : (rank + 1) * share]
            raw_put["thread"] = threading.Thread(
                target=saving.store.fs.pipe_file, args=(raw_path, raw_put["payload"]), daemon=True
            )
            raw_put["thread"].start()

    variants = {
        "bare": (endless(bare_loader), bare_step),
        "harness": (endless(quiet_loader), quiet_step),
        "harness_ckpt": (endless(saving_loader), saving_step),
        "bare_put": (endless(bare_loader), bare_put_step),
    }

    def block(name: str) -> float:
        batches, step_fn = variants[name]
        dist.barrier()
        started = time.perf_counter()
        for _ in range(steps):
            step_fn(next(batches))
        waiting = time.perf_counter()
        saving.checkpointer.wait()  # no-op for the other variants
        wait_raw_put()
        ended = time.perf_counter()
        if name == "harness_ckpt":
            tail_waits.append(ended - waiting)
        seconds = ended - started
        saving._drain_reports()  # Ray's bookkeeping of the reports, before the next block
        return seconds / steps

    for _ in range(every // 2):  # the offset: saves at the middle of the checkpointing variant's blocks
        saving_step(next(variants["harness_ckpt"][0]))
    tail_waits: list[float] = []
    names = list(variants)
    for name in names:  # warm-up: allocations, the first save's staging buffers, connections
        block(name)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for index in range(rounds):
        # Rotate the order: each variant follows each other one equally often.
        for name in names[index % len(names) :] + names[: index % len(names)]:
            times[name].append(block(name))
    committed = sum(1 for r in saving.checkpointer.results if r.committed)
    timed_saves = [r for r in saving.checkpointer.results[-rounds * (steps // every) :] if r.committed]
    stall = statistics.mean(r.blocked_seconds for r in timed_saves) if timed_saves else 0.0
    save_seconds = statistics.mean(r.total_seconds for r in timed_saves) if timed_saves else 0.0
    if rank == 0:
        # Train V2 hands the driver only checkpointed metrics: the result goes next to the run's checkpoints.
        with saving.store.fs.open(f"{saving.store.root}/{OVERHEAD_RESULT}", "w") as handle:
            json.dump(
                {
                    "times": times,
                    "committed": committed,
                    "stall_s": stall,
                    "save_s": save_seconds,
                    "tail_wait_s": statistics.mean(tail_waits[1:] or [0.0]),
                },
                handle,
            )
    dist.barrier()


def bench_overhead(
    uri: str,
    workers: int = 2,
    rounds: int = 12,
    steps: int = 40,
    every_steps: int = 20,
    width: int = 1024,
    batch: int = 256,
) -> OverheadBench:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    check_storage(uri)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"bench-overhead-{stamp}"
    spec = JobSpec.model_validate(
        {
            "name": "bench-overhead",
            "entrypoint": "elastic.bench.harness:unused",
            "workers": {"min": workers, "cpus": 1},
            "checkpoint": {"uri": uri, "every_steps": every_steps, "keep": 2},
        }
    )
    ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
    filesystem, storage_path = pyarrow_filesystem(uri)
    trainer = TorchTrainer(
        _overhead_worker,
        train_loop_config={
            "spec": spec.model_dump(mode="json"),
            "width": width,
            "batch": batch,
            "steps": steps,
            "rounds": rounds,
            "every_steps": every_steps,
            # Both harness variants report into this run's folder; separate subfolders keep
            # their checkpoints apart.
            "run_names": {str(10**9): name, str(every_steps): name},
        },
        scaling_config=ScalingConfig(num_workers=workers, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name=name, storage_path=storage_path, storage_filesystem=filesystem),
    )
    trainer.fit()

    store = CheckpointStore(run_directory(spec, name))
    with store.fs.open(f"{store.root}/{OVERHEAD_RESULT}", "r") as handle:
        measured = json.load(handle)
    times = measured["times"]
    bare, quiet, saving, putting = (
        statistics.median(times[k]) for k in ("bare", "harness", "harness_ckpt", "bare_put")
    )
    # Ratios within a round (adjacent blocks), then the median over rounds: a slow spell of the shared machine
    # moves a round's variants together, and falls out of their ratio.
    paired = lambda key: statistics.median(a / b for a, b in zip(times[key], times["bare"]))  # noqa: E731
    per_step = 1000
    return OverheadBench(
        workers=workers,
        rounds=rounds,
        steps_per_block=steps,
        bare_step_ms=round(bare * per_step, 3),
        harness_step_ms=round(quiet * per_step, 3),
        harness_ckpt_step_ms=round(saving * per_step, 3),
        overhead_ratio=round(paired("harness"), 4),
        ckpt_overhead_ratio=round(paired("harness_ckpt"), 4),
        bare_put_step_ms=round(putting * per_step, 3),
        put_overhead_ratio=round(paired("bare_put"), 4),
        checkpoints_committed=int(measured["committed"]),
        checkpoint_every_steps=every_steps,
        save_stall_ms=round(measured["stall_s"] * 1000, 2),
        save_ms=round(measured["save_s"] * 1000, 1),
        block_end_wait_ms=round(measured["tail_wait_s"] * 1000, 1),
    )


def to_json(result) -> dict:
    return asdict(result)
