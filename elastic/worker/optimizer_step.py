"""What `session.optimize(loss)` does between a loss and an optimizer step: mixed precision, gradient
accumulation, clipping, and a guard against non-finite losses. Each piece is a small policy or a null object,
so the harness never branches on flags.

- Precision: bf16 runs the model's forward under autocast; fp16 adds a GradScaler (checkpointed with the
  run). fp32 is the null policy: no autocast, a scaler that scales by 1.
- Accumulation: DDP's gradient all-reduce (FSDP2's reduce-scatter) is skipped on all but the last micro-batch
  of a step (`no_sync`; `set_requires_gradient_sync`).
- Non-finite guard: a step whose loss is NaN/inf on any rank is skipped on every rank (they must agree, or
  their parameters diverge) and counted; K in a row stop the run with a clear error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as wrap

from elastic.config.spec import TrainSpec
from elastic.errors import NonFiniteLoss
from elastic.parallel.fsdp import local

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------------
# Precision


def autocast(precision: str, device: torch.device):
    """The autocast context for a precision; a no-op context for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=_AUTOCAST_DTYPES[precision])


def _to_fp32(value: Any) -> Any:
    """Outputs back to float32, so the loss is computed at full precision outside the model."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and value.dtype != torch.float32 else value
    if isinstance(value, dict):
        return type(value)({k: _to_fp32(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        items = [_to_fp32(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    return value


def autocast_forward(model: torch.nn.Module, precision: str, device: torch.device) -> None:
    """Run `model`'s forward under autocast with float32 outputs (what Accelerate and Lightning do)."""
    if precision == "fp32":
        return
    forward = model.forward

    @functools.wraps(forward)
    def forward_in_precision(*args, **kwargs):
        with autocast(precision, device):
            return _to_fp32(forward(*args, **kwargs))

    model.forward = forward_in_precision


class NoScaler:
    """The null GradScaler (fp32, bf16): backward on the plain loss, step the optimizer, nothing to save."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        pass

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def update(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def grad_scaler(precision: str, device: torch.device):
    """fp16 needs loss scaling (its range underflows small gradients); bf16 and fp32 do not.

    Under fsdp each rank holds its own slice of the gradients, so only one rank may see an overflow: the plain
    GradScaler still keeps the ranks together, as DTensor all-reduces the overflow finding of its unscale op
    (torch.distributed.tensor's found_inf_reduce_handler); a test forces the case."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else NoScaler()


# ---------------------------------------------------------------------------------------------------------
# Activation checkpointing


def apply_activation_checkpointing(
    model: torch.nn.Module, layers: Callable[[torch.nn.Module], bool] | tuple[type, ...] | None
) -> int:
    """Wrap the chosen submodules so their activations are recomputed in backward. `layers` is a predicate or
    a tuple of module types; by default every direct child of the model. Returns how many were wrapped.

    The wrapper strips its own prefix from state_dict keys, so checkpoints load with or without it."""
    if layers is None:
        children = {id(child) for child in model.children()}
        check = lambda module: id(module) in children  # noqa: E731
    elif isinstance(layers, tuple):
        check = lambda module: isinstance(module, layers)  # noqa: E731
    else:
        check = layers
    wrapped = [m for m in model.modules() if m is not model and check(m)]
    wrap(model, check_fn=check)
    return len(wrapped)


# ---------------------------------------------------------------------------------------------------------
# Non-finite guard


class NonFiniteGuard:
    """Pure policy: count skipped steps; raise once `limit` steps in a row had a non-finite loss."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.skipped = 0

    def record(self, finite: bool, step: int) -> bool:
        """Returns whether the step may be applied."""
        if finite:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.in_a_row >= self.limit:
            raise NonFiniteLoss(
                f"the loss (or its gradients) was NaN or infinite for {self.in_a_row} steps in a row "
                f"(up to step {step}); "
                f"lower the learning rate, use bf16 instead of fp16, or check the data; "
                f"train.max_nonfinite_steps={self.limit}"
            )
        return False

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.skipped = int(state["in_a_row"]), int(state["skipped"])


# ---------------------------------------------------------------------------------------------------------
# The step


def _gradients_finite(optimizer: torch.optim.Optimizer) -> bool:
    """A non-finite loss is multiplied by NaN before backward, so every gradient it reaches is NaN in every
    element, on every rank once all-reduced: one element per tensor tells, where a norm over all of them cost
    a pass over the model each step."""
    probes = [
        local(p.grad).reshape(-1)[:1]
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None and local(p.grad).numel()
    ]
    return not probes or bool(torch.isfinite(torch.cat(probes)).all())


class OptimizerStep:
    """Turns micro-batch losses into optimizer steps. `optimize(loss)` returns True when it completed a step
    (applied or skipped), i.e. on the last micro-batch of an accumulation window."""

    def __init__(
        self,
        spec: TrainSpec,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler,
        guard: NonFiniteGuard,
        scheduler=None,
        group=None,
    ):
        self.spec = spec
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.guard = guard
        self.scheduler = scheduler
        self.group = group
        self.micro = 0
        self._nonfinite = False

    def optimize(self, loss: torch.Tensor, step: int) -> tuple[bool, bool]:
        """Backward for one micro-batch; on the window's last one, step. Returns (step_done, applied)."""
        self.micro += 1
        last = self.micro >= self.spec.grad_accumulation
        finite = bool(torch.isfinite(loss.detach()).all())
        self._nonfinite |= not finite
        if not finite and self._agree_through_gradients:
            # Make every gradient it reaches NaN (an inf loss can leave some finite): DDP's all-reduce then
            # spreads the news to every rank.
            loss = loss * float("nan")
        if self.spec.grad_accumulation > 1:
            loss = loss / self.spec.grad_accumulation
        scaled = self.scaler.scale(loss)
        # Every rank runs backward even on a NaN loss: DDP's all-reduce (FSDP's reduce-scatter) is collective.
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter on the last only
            self.model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext()
        else:
            sync = contextlib.nullcontext() if last or not hasattr(self.model, "no_sync") else self.model.no_sync()
        with sync:
            scaled.backward()
        if not last:
            return False, False
        self.micro = 0
        clipped = False
        if self._agree_through_gradients and not self._sharded:
            # The gradients are all-reduced, so identical on every rank: so is this decision, for free.
            bad = not _gradients_finite(self.optimizer)
        elif self._agree_through_gradients and self.spec.grad_clip_norm is not None:
            # Sharded and clipped: the total norm is all-reduced anyway, and non-finite iff any rank's slice
            # is. Clipping by a NaN norm spoils the gradients of a step that is skipped: no harm.
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip_norm)
            bad = not bool(torch.isfinite(local(norm)).all())
            clipped = True
        elif self._agree_through_gradients:
            # Sharded: each rank sees only its own slice of the reduced gradients. A NaN loss reaches every
            # slice, but an overflow in backward (finite loss) lands in one rank's slice only, and a rank may
            # hold no element at all: one flag, agreed, so no rank steps (or clips, a collective) alone.
            bad = self._any_rank(not _gradients_finite(self.optimizer))
        else:
            # fp16: the scaler's overflow also makes gradients non-finite, which is not a bad loss; ask the ranks.
            bad = self._any_rank(self._nonfinite)
        applied = self.guard.record(not bad, step)
        self._nonfinite = False
        if applied:
            if self.spec.grad_clip_norm is not None and not clipped:
                self.scaler.unscale_(self.optimizer)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.spec.grad_clip_norm)
            self.scaler.step(self.optimizer)
            self.scaler.update()
            if self.scheduler is not None:
                self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True, applied

    @property
    def _sharded(self) -> bool:
        return hasattr(self.model, "set_requires_gradient_sync")

    @property
    def _agree_through_gradients(self) -> bool:
        """Without loss scaling, a step is skipped iff its (all-reduced) gradients are non-finite: no extra
        collective per step, which on a busy host cost a third of the step time."""
        return isinstance(self.scaler, NoScaler)

    def _any_rank(self, flag: bool) -> bool:
        if not dist.is_initialized():
            return flag
        tensor = torch.tensor([1 if flag else 0])
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.group)
        return bool(tensor.item())
