"""session.optimize's step logic under real DDP and FSDP2 (2 gloo processes, no Ray): a NaN loss on one rank
only is skipped by both ranks, whose parameters stay identical; accumulation syncs gradients once per step."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


# The models: under fsdp each rank holds a slice of every parameter; "fsdp-empty-rank" is a model so small that
# rank 1 holds no element at all (every dim 0 is 1), where the ranks must agree by a collective instead.
MODELS = {"ddp": (4, 8, 2), "fsdp": (4, 8, 2), "fsdp-empty-rank": (4, 1, 1)}


def _rank(rank: int, world: int, store: str, out: str, precision: str, parallelism: str = "ddp") -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (before init_process_group: see the end)
    import torch.nn.functional as F

    from elastic.config.spec import TrainSpec
    from elastic.worker.optimizer_step import NonFiniteGuard, OptimizerStep, grad_scaler

    # A file store: no port picked ahead of time that another process could take in between.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    width_in, hidden, classes = MODELS[parallelism]
    model = torch.nn.Sequential(torch.nn.Linear(width_in, hidden), torch.nn.Linear(hidden, classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sharded = parallelism.startswith("fsdp")
    spec = TrainSpec(precision=precision, grad_accumulation=2, parallelism="fsdp" if sharded else "ddp")
    if sharded:
        from elastic.parallel.fsdp import shard_model

        model, _ = shard_model(model, optimizer, spec.fsdp, precision)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    step = OptimizerStep(spec, model, optimizer, grad_scaler(precision, torch.device("cpu")), NonFiniteGuard(3))
    outcomes = []
    for i in range(4):
        for micro in range(2):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * i + micro + 100 * rank))
            logits = model(x)
            loss = F.cross_entropy(logits, torch.tensor([0, 1, 0, 1])) if classes > 1 else logits.square().mean()
            if i == 1 and rank == 1 and micro == 0:
                loss = loss * float("nan")  # a bad batch on one rank only
            done, applied = step.optimize(loss, i + 1)
        outcomes.append(applied)
    params = [(p.full_tensor() if sharded else p).detach().flatten().tolist() for p in model.parameters()]
    gathered = [None] * world
    dist.all_gather_object(gathered, {"outcomes": outcomes, "params": params, "guard": step.guard.state_dict()})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    # The gloo group must really end here, its worker threads joined while the interpreter is alive: a worker
    # still dropping the last collective's tensors (Python-owned: it takes the GIL to free them) when the
    # process exits is killed by Py_Finalize inside a noexcept destructor: SIGABRT, "terminate called without
    # an active exception", now and then. destroy_process_group only drops torch.distributed's references, so
    # (1) the DDP Reducer's goes first (the model and the step holding it), and (2) torch.distributed.nn is
    # imported above, before the group exists: DDP imports it otherwise (through torch._dynamo), and its
    # functions' `group=group.WORLD` defaults would keep the default group alive until the process exits.
    del step, optimizer, model, logits, loss
    gc.collect()
    dist.destroy_process_group()
    if not sharded:  # FSDP2's modules outlive any `del`: torch's composable-state map (a WeakKeyDictionary whose
        # values hold their keys) keeps each one, its mesh and so the group, until the process ends
        assert _gloo_threads() == [], f"gloo threads outlived destroy_process_group: {_gloo_threads()}"


def _gloo_threads() -> list[str]:
    """This process's threads that gloo's process groups own (pt_gloo_runloop, gloo_tcp_loop), by name."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():  # not Linux: nothing to check
        return []
    names = []
    for task in os.listdir(tasks):
        try:
            names.append((tasks / task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return [name for name in names if "gloo" in name]


@pytest.mark.parametrize(
    "parallelism,precision", [("ddp", "fp32"), ("ddp", "fp16"), ("fsdp", "fp32"), ("fsdp-empty-rank", "fp32")]
)
def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path, parallelism, precision):
    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(out), precision, parallelism), nprocs=2, join=True)
    ranks = json.loads(out.read_text())
    assert [r["outcomes"] for r in ranks] == [[True, False, True, True]] * 2
    assert ranks[0]["params"] == ranks[1]["params"]  # still replicas
    assert all(r["guard"] == {"in_a_row": 0, "skipped": 1} for r in ranks)
