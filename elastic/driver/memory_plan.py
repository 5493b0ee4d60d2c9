"""At submit: a job that declares its model (`planned_model(config)` in its entrypoint's module) is refused,
before anything starts, when its training state cannot fit the GPUs its workers will get.

The hook is the one piece of the user's code `submit` runs on the client (only when the module defines it and
the job asks for GPUs): a model's size is the job's to say, e.g. from `config.size`."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

from elastic.config.spec import JobSpec
from elastic.errors import SpecError
from elastic.parallel.planning import ModelPlan, refusal, smallest_gpu_memory
from elastic.placement.policy import NodeView

HOOK = "planned_model"
ACCELERATOR_RESOURCE = "accelerator_type:"  # Ray's resource naming a node's GPU type


def check_memory(spec: JobSpec, working_dir: Path, nodes: list[NodeView] | None, source: str | None) -> None:
    """Raise SpecError (one line: the need, the GPU, the fix) when the plan cannot fit; quiet when the job plans
    nothing, trains on CPUs, or the GPU's memory is unknown (no `workers.gpu_memory_gb`, no `nodes` to ask)."""
    workers = spec.workers
    if workers.gpus_at_most <= 0:
        return
    if workers.gpu_memory_gb is not None:
        gpu, memory = "the GPU (workers.gpu_memory_gb)", workers.gpu_memory_gb
    else:
        types = [
            name[len(ACCELERATOR_RESOURCE) :]
            for node in nodes or []
            for name in node.total
            if name.startswith(ACCELERATOR_RESOURCE)
        ]
        found = smallest_gpu_memory(types)
        if found is None:
            return
        # A fractional GPU (packed trials) gets that share of the card's memory.
        gpu, memory = f"a worker's share of the {found[0]} GPU", found[1] * min(1.0, workers.gpus_at_most)
    plan = load_plan(spec, working_dir)
    if plan is None:
        return
    line = refusal(plan, spec.train.parallelism, workers.min, memory, gpu, spec.train.fsdp.cpu_offload)
    if line:
        raise SpecError(f"{source or spec.name}: {line}")


def load_plan(spec: JobSpec, working_dir: Path) -> ModelPlan | None:
    target = spec.entrypoint_target
    path = working_dir / target
    if not target.endswith(".py") or not path.is_file():
        return None  # a module path is importable only in the job's environment
    tree = ast.parse(path.read_bytes(), filename=str(path))
    if not any(isinstance(node, ast.FunctionDef) and node.name == HOOK for node in tree.body):
        return None
    sys.path.insert(0, str(working_dir))  # the module imports its neighbours as the worker would
    try:
        module_spec = importlib.util.spec_from_file_location(f"_elastic_plan_{path.stem}", path)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        answer = getattr(module, HOOK)(dict(spec.config))
    except Exception as err:  # the user's code: any failure is theirs to fix, said in one line
        raise SpecError(
            f"entrypoint: {target}: {HOOK}(config) failed ({type(err).__name__}: {err}); fix it or remove it"
        ) from None
    finally:
        sys.path.remove(str(working_dir))
    return _as_plan(answer, target)


def _as_plan(answer, target: str) -> ModelPlan:
    if isinstance(answer, int) and not isinstance(answer, bool):
        answer = {"parameters": answer}
    if not isinstance(answer, dict) or not isinstance(answer.get("parameters"), int) or answer["parameters"] <= 0:
        raise SpecError(
            f"entrypoint: {target}: {HOOK}(config) returned {answer!r}; return "
            "{'parameters': <int>, 'optimizer': 'AdamW'} (or the parameter count)"
        )
    return ModelPlan(parameters=answer["parameters"], optimizer=str(answer.get("optimizer", "AdamW")))
