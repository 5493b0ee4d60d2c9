"""session.optimize's step logic under real DDP (2 gloo processes, no Ray): a NaN loss on one rank only is
skipped by both ranks, whose parameters stay identical; accumulation syncs gradients once per step."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _rank(rank: int, world: int, store: str, out: str, precision: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.nn  # noqa: F401  (before init_process_group: see the end)
    import torch.nn.functional as F

    from elastic.config.spec import TrainSpec
    from elastic.worker.optimizer_step import NonFiniteGuard, OptimizerStep, grad_scaler

    # A file store: no port picked ahead of time that another process could take in between.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = TrainSpec(precision=precision, grad_accumulation=2)
    step = OptimizerStep(spec, model, optimizer, grad_scaler(precision, torch.device("cpu")), NonFiniteGuard(3))
    outcomes = []
    for i in range(4):
        for micro in range(2):
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * i + micro + 100 * rank))
            loss = F.cross_entropy(model(x), torch.tensor([0, 1, 0, 1]))
            if i == 1 and rank == 1 and micro == 0:
                loss = loss * float("nan")  # a bad batch on one rank only
            done, applied = step.optimize(loss, i + 1)
        outcomes.append(applied)
    params = [p.detach().flatten().tolist() for p in model.parameters()]
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
    del step, optimizer, model
    dist.destroy_process_group()
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


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path, precision):
    import torch.multiprocessing as mp

    out = tmp_path / "result.json"
    mp.spawn(_rank, args=(2, str(tmp_path / "store"), str(out), precision), nprocs=2, join=True)
    ranks = json.loads(out.read_text())
    assert [r["outcomes"] for r in ranks] == [[True, False, True, True]] * 2
    assert ranks[0]["params"] == ranks[1]["params"]  # still replicas
    assert all(r["guard"] == {"in_a_row": 0, "skipped": 1} for r in ranks)
