"""`elastic bench overhead`: one Ray Train run with W workers trains the same model on the same data through a
bare DDP loop (or, with parallelism fsdp, a bare FSDP2 loop: `fully_shard` on each layer and the root) and
through the harness (checkpoints off; then async checkpoints every 20 steps), in short blocks
that rotate through the variants, so that drift on a shared machine hits every variant alike. Reports step-time
ratios taken within each round of blocks (median over rounds). A fourth variant, the bare loop plus a raw PUT of
the same bytes at the same interval, is the floor: what moving the bytes alone costs the training. Under fsdp a
fifth, the bare loop plus the one-element all-reduce by which sharded ranks agree to skip a non-finite step
(an overflow lands in one rank's gradient slice only), is the floor of the harness's guard."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from dataclasses import dataclass

from elastic import logs
from elastic.checkpoint.store import CheckpointStore, run_directory
from elastic.config.spec import JobSpec
from elastic.parallel.fsdp import local
from elastic.storage import check_storage, pyarrow_filesystem
from elastic.worker.session import Session

OVERHEAD_RESULT = "bench-overhead.json"


@dataclass
class OverheadBench:
    workers: int
    parallelism: str  # ddp or fsdp, the bare loop and the harness alike
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
    # fsdp only: the bare loop plus one agreed non-finite flag per step (a one-element all-reduce), over bare;
    # and the harness over that floor, i.e. what the harness costs beyond the agreement a sharded guard needs.
    agreed_overhead_ratio: float | None = None
    harness_vs_agreed: float | None = None


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
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    logs.configure()  # a Ray Train worker process: the session's lines get the same format as a job's

    torch.manual_seed(0)
    width, batch, steps, rounds = config["width"], config["batch"], config["steps"], config["rounds"]
    every = config["every_steps"]
    if steps % every or steps < every:
        raise ValueError(f"steps per block ({steps}) must be a multiple of the checkpoint interval ({every})")
    rank, world = dist.get_rank(), dist.get_world_size()
    samples = batch * 4 * steps * world  # epochs of a few blocks: the loaders' epoch turns are timed too
    data = TensorDataset(torch.randn(samples, width), torch.randint(0, 10, (samples,)))

    # The bare baseline: what a user writes with Ray Train and plain PyTorch.
    fsdp = config["parallelism"] == "fsdp"
    if fsdp:
        bare_model = _bench_model(width)
        for layer in bare_model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(bare_model)
    else:
        bare_model = DistributedDataParallel(_bench_model(width))
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
    bare_loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, world, rank, seed=0))

    def bare_step(batch_data) -> None:
        x, y = batch_data
        loss = F.cross_entropy(bare_model(x), y)
        bare_opt.zero_grad()
        loss.backward()
        bare_opt.step()

    def bare_agreed_step(batch_data) -> None:
        """The bare loop as it must be to skip a non-finite step on every rank under sharding: one flag, agreed."""
        x, y = batch_data
        loss = F.cross_entropy(bare_model(x), y)
        bare_opt.zero_grad()
        loss.backward()
        flag = torch.tensor(
            [
                0
                if all(
                    bool(torch.isfinite(local(p.grad).reshape(-1)[:1]).all())
                    for p in bare_model.parameters()
                    if p.grad is not None
                )
                else 1
            ]
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            bare_opt.step()

    def harness(every_steps: int):
        spec = JobSpec.model_validate(
            {**config["spec"], "checkpoint": {**config["spec"]["checkpoint"], "every_steps": every_steps}}
        )
        session = Session(spec, config["run_names"][str(every_steps)])
        model = _bench_model(width)
        # Under fsdp the harness shards the same units as the bare loop (each layer, then the root).
        shard = (nn.Linear,) if fsdp else None
        model, optimizer = session.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3), shard=shard)
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
                state = [local(p.detach()) for p in bare_model.parameters()] + [
                    local(t) for s in bare_opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
                ]
                flat = torch.cat([t.flatten().float() for t in state]).numpy().tobytes()
                share = len(flat) if fsdp else len(flat) // world  # fsdp: this rank's shards are its share
                raw_put["payload"] = flat[rank * share : (rank + 1) * share] if not fsdp else flat
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
    if fsdp:
        variants["bare_agreed"] = (endless(bare_loader), bare_agreed_step)

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
        saving.drain_reports()  # Ray's bookkeeping of the reports, before the next block
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
    parallelism: str = "ddp",
) -> OverheadBench:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    check_storage(uri)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"bench-overhead-{parallelism}-{stamp}"
    spec = JobSpec.model_validate(
        {
            "name": "bench-overhead",
            "entrypoint": "elastic.bench.overhead:unused",
            "workers": {"min": workers, "cpus": 1},
            "checkpoint": {"uri": uri, "every_steps": every_steps, "keep": 2},
            "train": {"parallelism": parallelism},
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
            "parallelism": parallelism,
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
    agreed = {}
    if "bare_agreed" in times:
        agreed = {
            "agreed_overhead_ratio": round(paired("bare_agreed"), 4),
            "harness_vs_agreed": round(
                statistics.median(a / b for a, b in zip(times["harness"], times["bare_agreed"])), 4
            ),
        }
    return OverheadBench(
        workers=workers,
        parallelism=parallelism,
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
        **agreed,
    )
