"""`train.parallelism: fsdp`: FSDP2 (`torch.distributed.fsdp.fully_shard`) on the modules to shard and the
root, with the job's optimizer rebound to the sharded parameters, so the training loop is the one it has under DDP.

The optimizer a job passes to `session.prepare` was built over the unsharded parameters; fully_shard replaces
each parameter with a DTensor one. Rather than build another optimizer (and leave a scheduler bound to the old
one), the same optimizer object gets the new parameters in its param groups, by name: its class, groups and
hyperparameters stay, and so does every scheduler bound to it. It has no state yet (prepare comes before the
first step), which a rebind would otherwise have to carry over.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from elastic.config.spec import FsdpSpec
from elastic.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

ShardSpec = tuple[type, ...] | Callable[[torch.nn.Module], bool] | None


def default_shard_units(model: torch.nn.Module) -> tuple[list[torch.nn.Module], str]:
    """The modules to shard when a job names none: the entries of the model's ModuleLists (a transformer's
    blocks: one all-gather per block, freed after it), else the model's direct children that hold parameters."""
    blocks = [
        child
        for module in model.modules()
        if isinstance(module, torch.nn.ModuleList)
        for child in module
        if any(True for _ in child.parameters())
    ]
    if blocks:
        return blocks, "the entries of the model's ModuleLists"
    children = [child for child in model.children() if any(True for _ in child.parameters())]
    return children, "the model's direct children"


def shard_units(model: torch.nn.Module, shard: ShardSpec) -> tuple[list[torch.nn.Module], str]:
    """The submodules to wrap with fully_shard (each its own all-gather unit) before the root."""
    if shard is None:
        return default_shard_units(model)
    if isinstance(shard, tuple):
        check = lambda module: isinstance(module, shard)  # noqa: E731
        described = ", ".join(t.__name__ for t in shard)
    else:
        check, described = shard, "the modules the shard predicate chose"
    units = [m for m in model.modules() if m is not model and check(m)]
    # A unit inside another unit would be gathered twice: keep the outermost.
    inside = {id(inner) for unit in units for inner in unit.modules() if inner is not unit}
    return [m for m in units if id(m) not in inside], described


def mixed_precision(spec: FsdpSpec, precision: str) -> tuple[MixedPrecisionPolicy, MixedPrecisionPolicy]:
    """(inner, root) policies: parameters gathered in param_dtype (default: train.precision), gradients
    reduced in reduce_dtype; the root alone turns its outputs back to float32 (an inner unit doing so would
    hand float32 activations to the root's own low-precision layers)."""
    param = DTYPES[spec.mixed_precision.param_dtype or precision]
    reduce = DTYPES[spec.mixed_precision.reduce_dtype] if spec.mixed_precision.reduce_dtype else None
    if param == torch.float32:
        plain = MixedPrecisionPolicy(reduce_dtype=reduce)
        return plain, plain
    inner = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)
    root = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce, output_dtype=torch.float32)
    return inner, root


def shard_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    spec: FsdpSpec,
    precision: str,
    shard: ShardSpec = None,
) -> tuple[torch.nn.Module, str]:
    """fully_shard each unit, then the root; rebind `optimizer` in place. Returns the model (the same object,
    now an FSDPModule) and a line for the log."""
    names = _parameter_names(model, optimizer) if optimizer is not None else None
    units, described = shard_units(model, shard)
    inner, root = mixed_precision(spec, precision)
    offload = CPUOffloadPolicy() if spec.cpu_offload else OffloadPolicy()
    options = {"reshard_after_forward": spec.reshard_after_forward, "offload_policy": offload}
    for unit in units:
        fully_shard(unit, mp_policy=inner, **options)
    fully_shard(model, mp_policy=root, **options)
    if optimizer is not None:
        _rebind(optimizer, names, model)
    param = spec.mixed_precision.param_dtype or precision
    return model, (
        f"fsdp: {len(units)} units ({described}) and the root, parameters in {param}, gradients reduced in "
        f"{spec.mixed_precision.reduce_dtype or param}, reshard after forward {spec.reshard_after_forward}"
        + (", offloaded to CPU" if spec.cpu_offload else "")
    )


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _parameter_names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    by_id = {id(p): name for name, p in model.named_parameters()}
    missing = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in by_id]
    if missing:
        raise UserError(
            f"the optimizer holds {len(missing)} parameter(s) that are not the model's; build it over "
            "model.parameters() before session.prepare(model, optimizer)"
        )
    if optimizer.state:
        raise UserError("the optimizer has already stepped; pass it to session.prepare before the first step")
    return [[by_id[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _rebind(optimizer: torch.optim.Optimizer, names: list[list[str]], model: torch.nn.Module) -> None:
    sharded = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names):
        group["params"] = [sharded[name] for name in group_names]
