"""Restoring an adopted checkpoint keeps the trial's own hyperparameters and bookkeeping
(elastic.worker.adoption), on a real optimizer and LR scheduler."""

from __future__ import annotations

import pytest
import torch

from elastic.worker.adoption import Adoption
from elastic.worker.training_state import TrainingState


class Counter:
    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def trained(lr: float, steps: int, scheduler: bool) -> TrainingState:
    torch.manual_seed(0)
    state = TrainingState(rank=0, world_size=1, gather=lambda world: [{}])
    state.model = torch.nn.Linear(3, 2)
    state.optimizer = torch.optim.SGD(state.model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    if scheduler:
        state.tracked["lr_scheduler"] = torch.optim.lr_scheduler.StepLR(state.optimizer, step_size=2, gamma=0.5)
    state.tracked["elastic.goodput"] = Counter(steps)
    for _ in range(steps):
        state.model(torch.ones(1, 3)).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        if scheduler:
            state.tracked["lr_scheduler"].step()
    return state


def load(recipient: TrainingState, donor: TrainingState) -> None:
    """What a restore does with the donor's checkpoint (its state dicts), without storage."""
    recipient.optimizer.load_state_dict(donor.optimizer.state_dict())
    recipient.model.load_state_dict(donor.model.state_dict())
    for name, obj in donor.tracked.items():
        recipient.tracked[name].load_state_dict(obj.state_dict())


def test_without_a_schedule_the_trial_gets_exactly_its_own_lr_and_keeps_the_donors_moments():
    donor = trained(lr=0.1, steps=3, scheduler=False)
    recipient = trained(lr=0.037, steps=0, scheduler=False)
    recipient.optimizer.param_groups[0]["weight_decay"] = 0.0  # mutated too
    adoption = Adoption(recipient)
    load(recipient, donor)
    assert recipient.optimizer.param_groups[0]["lr"] == 0.1  # what a plain restore leaves
    adoption.apply(recipient)
    group = recipient.optimizer.param_groups[0]
    assert group["lr"] == 0.037 and group["weight_decay"] == 0.0 and group["momentum"] == 0.9
    moments = [s["momentum_buffer"] for s in recipient.optimizer.state.values()]
    assert all(
        torch.equal(a, b)
        for a, b in zip(moments, [s["momentum_buffer"] for s in donor.optimizer.state.values()], strict=True)
    )
    assert recipient.tracked["elastic.goodput"].value == 0  # its own bookkeeping, not the donor's 3


def test_a_schedule_keeps_its_progress_at_the_trials_own_scale():
    donor = trained(lr=0.1, steps=4, scheduler=True)  # StepLR halved twice: lr 0.025
    recipient = trained(lr=0.2, steps=0, scheduler=True)
    adoption = Adoption(recipient)
    load(recipient, donor)
    adoption.apply(recipient)
    scheduler = recipient.tracked["lr_scheduler"]
    assert recipient.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)  # 0.025 x 0.2 / 0.1
    assert recipient.optimizer.param_groups[0]["initial_lr"] == 0.2 and scheduler.base_lrs == [0.2]
    recipient.optimizer.step()
    scheduler.step()
    scheduler.step()
    assert recipient.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.025
    )  # halved once more at step 6, from its own scale
