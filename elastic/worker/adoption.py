"""Restoring a checkpoint adopted from another trial (PBT's exploit, elastic.sweep.exploit).

The recipient continues the donor's model, optimizer state, data position and random streams, but under its
own, mutated hyperparameters: a plain restore would bring back the donor's (the optimizer's param groups carry
their lr, weight decay, momentum...). So before the load the fresh optimizer's hyperparameters (built from this
trial's config) are noted, and after it they are put back, the lr scaled by how far the donor's LR schedule
had moved it (lr = donor's current lr x this trial's initial lr / the donor's initial lr: a job without a
scheduler gets exactly its configured lr). The run's own bookkeeping (its MLflow run, its goodput counters)
is its own, not the donor's.
"""

from __future__ import annotations

from typing import Any

from elastic.worker.training_state import TrainingState

OWN_STATE = ("elastic.tracking", "elastic.goodput")  # the run's, not the donor's
_NOT_HYPERPARAMETERS = ("params", "initial_lr", "lr")


class Adoption:
    """Noted before the load of an adopted checkpoint; `apply` after it."""

    def __init__(self, state: TrainingState):
        optimizer = state.optimizer
        self.groups: list[dict[str, Any]] = (
            [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            if optimizer is not None
            else []
        )
        self.own = {name: state.tracked[name].state_dict() for name in OWN_STATE if name in state.tracked}

    def apply(self, state: TrainingState) -> str:
        """Put this trial's hyperparameters and bookkeeping back; returns what was set, for the log."""
        for name, saved in self.own.items():
            state.tracked[name].load_state_dict(saved)
        if state.optimizer is None:
            return "no optimizer"
        said = []
        for index, (group, fresh) in enumerate(zip(state.optimizer.param_groups, self.groups, strict=True)):
            fresh_initial = fresh.get("initial_lr", fresh["lr"])
            donor_initial = group.get("initial_lr", group["lr"])
            if group["lr"] == donor_initial or not donor_initial:  # not moved by a schedule: exactly this trial's
                group["lr"] = fresh_initial
            else:
                group["lr"] = group["lr"] * fresh_initial / donor_initial
            if "initial_lr" in group:
                group["initial_lr"] = fresh_initial
            for key, value in fresh.items():
                if key not in _NOT_HYPERPARAMETERS:
                    group[key] = value
            said.append(f"group {index}: lr {group['lr']:.6g}")
        scheduler = state.tracked.get("lr_scheduler")
        if scheduler is not None and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [fresh.get("initial_lr", fresh["lr"]) for fresh in self.groups]
        return ", ".join(said)
