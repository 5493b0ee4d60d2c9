"""The step helpers behind session.optimize: precision, accumulation, clipping, the non-finite guard and
activation checkpointing, on a real model in one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from elastic.config.spec import TrainSpec
from elastic.errors import NonFiniteLoss
from elastic.worker.optimizer_step import (
    NonFiniteGuard,
    NoScaler,
    OptimizerStep,
    apply_activation_checkpointing,
    autocast_forward,
    grad_scaler,
)

CPU = torch.device("cpu")


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    return model, x, y


def stepper(model, spec: TrainSpec, lr: float = 0.1, scheduler_factory=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = scheduler_factory(optimizer) if scheduler_factory else None
    return OptimizerStep(
        spec, model, optimizer, grad_scaler(spec.precision, CPU), NonFiniteGuard(spec.max_nonfinite_steps), scheduler
    ), optimizer


def test_accumulating_two_halves_equals_one_step_on_the_whole_batch():
    model, x, y = model_and_data()
    reference = copy.deepcopy(model)
    whole, _ = stepper(reference, TrainSpec())
    assert whole.optimize(F.cross_entropy(reference(x), y), step=1) == (True, True)

    halves, _ = stepper(model, TrainSpec(grad_accumulation=2))
    assert halves.optimize(F.cross_entropy(model(x[:8]), y[:8]), step=1) == (False, False)
    assert halves.optimize(F.cross_entropy(model(x[8:]), y[8:]), step=1) == (True, True)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_grad_clipping_bounds_the_update():
    model, x, y = model_and_data()
    before = [p.detach().clone() for p in model.parameters()]
    step, _ = stepper(model, TrainSpec(grad_clip_norm=1e-3), lr=1.0)
    step.optimize(F.cross_entropy(model(x), y) * 1000, step=1)
    moved = torch.sqrt(sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), before)))
    assert 0 < moved.item() <= 1e-3 * 1.0001  # lr 1, momentum's first step = the clipped gradient


def test_nonfinite_loss_skips_the_step_and_counts_it():
    model, x, y = model_and_data()
    step, _ = stepper(model, TrainSpec(max_nonfinite_steps=3))
    before = [p.detach().clone() for p in model.parameters()]
    assert step.optimize(F.cross_entropy(model(x), y) * float("nan"), step=1) == (True, False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())  # the poisoned gradients are gone
    assert step.optimize(F.cross_entropy(model(x), y), step=2) == (True, True)
    assert step.guard.state_dict() == {"in_a_row": 0, "skipped": 1}


def test_nonfinite_losses_in_a_row_stop_with_a_clear_error():
    model, x, y = model_and_data()
    step, _ = stepper(model, TrainSpec(max_nonfinite_steps=2))
    step.optimize(F.cross_entropy(model(x), y) * float("inf"), step=1)
    with pytest.raises(NonFiniteLoss, match="2 steps in a row .*max_nonfinite_steps=2"):
        step.optimize(F.cross_entropy(model(x), y) * float("nan"), step=2)


def test_nonfinite_micro_batch_poisons_its_whole_accumulation_window():
    model, x, y = model_and_data()
    step, _ = stepper(model, TrainSpec(grad_accumulation=2))
    before = [p.detach().clone() for p in model.parameters()]
    step.optimize(F.cross_entropy(model(x[:8]), y[:8]) * float("nan"), step=1)
    assert step.optimize(F.cross_entropy(model(x[8:]), y[8:]), step=1) == (True, False)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_scheduler_steps_with_the_optimizer_but_not_on_skipped_steps():
    model, x, y = model_and_data()
    step, optimizer = stepper(
        model, TrainSpec(), scheduler_factory=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)
    )
    step.optimize(F.cross_entropy(model(x), y), step=1)
    step.optimize(F.cross_entropy(model(x), y) * float("nan"), step=2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_fp16_uses_a_grad_scaler_whose_state_round_trips():
    model, x, y = model_and_data()
    spec = TrainSpec(precision="fp16")
    autocast_forward(model, spec.precision, CPU)
    step, _ = stepper(model, spec)
    assert isinstance(step.scaler, torch.amp.GradScaler)
    for i in range(3):
        step.optimize(F.cross_entropy(model(x), y), step=i + 1)
    state = step.scaler.state_dict()
    assert state["scale"] > 0 and state["_growth_tracker"] == 3
    fresh = grad_scaler("fp16", CPU)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert isinstance(grad_scaler("bf16", CPU), NoScaler) and NoScaler().state_dict() == {}


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_autocast_forward_computes_in_low_precision_and_returns_float32(precision, dtype):
    model, x, _ = model_and_data()
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    autocast_forward(model, precision, CPU)
    out = model(x)
    assert seen == [dtype] and out.dtype == torch.float32


def test_fp32_forward_is_untouched():
    model, x, _ = model_and_data()
    forward = model.forward
    autocast_forward(model, "fp32", CPU)
    assert model.forward == forward


def test_activation_checkpointing_keeps_gradients_and_state_dict_keys():
    model, x, y = model_and_data()
    plain = copy.deepcopy(model)
    assert apply_activation_checkpointing(model, None) == 3  # the three direct children
    assert model.state_dict().keys() == plain.state_dict().keys()
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(plain(x), y).backward()
    for a, b in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_activation_checkpointing_by_module_type():
    model, _, _ = model_and_data()
    assert apply_activation_checkpointing(model, (nn.Linear,)) == 2
    assert "CheckpointWrapper" in repr(model[0]) and "CheckpointWrapper" not in repr(model[1])
