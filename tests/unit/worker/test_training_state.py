"""TrainingState, the torch Stateful a checkpoint holds: a round trip on a plain model and optimizer (no Ray,
no process group), with the random streams continuing exactly where they were captured."""

from __future__ import annotations

import copy
import pickle
import random

import numpy as np
import torch

from elastic.worker.training_state import TrainingState, capture_rng


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def _train_step(model, optimizer) -> None:
    loss = model(torch.randn(8, 4)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def _state(model, optimizer) -> tuple[TrainingState, Counter]:
    state = TrainingState(rank=0, world_size=1)
    counter = Counter()
    state.model, state.optimizer = model, optimizer
    state.tracked["counter"] = counter
    return state, counter


def test_round_trip_restores_model_optimizer_tracked_extras_step_and_streams():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step(model, optimizer)  # momentum buffers exist
    state, counter = _state(model, optimizer)
    state.step, state.extras, counter.count = 7, {"best": 0.5}, 3

    saved = copy.deepcopy(state.state_dict())  # get_state_dict shares the live tensors: copy, as a save does
    expected_draws = _draws()
    expected_params = [p.detach().clone() for p in model.parameters()]
    expected_momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    _train_step(model, optimizer)  # everything moves on
    state.step, state.extras, counter.count = 9, {}, 5

    state.load_state_dict(saved)
    assert state.step == 7 and state.extras == {"best": 0.5} and counter.count == 3
    for param, expected in zip(model.parameters(), expected_params):
        assert torch.equal(param, expected)
    for param, expected in zip(model.parameters(), expected_momentum):
        assert torch.equal(optimizer.state[param]["momentum_buffer"], expected)
    assert _draws() == expected_draws  # python, numpy and torch streams continue from the capture


def test_saved_state_has_tensors_and_one_blob():
    model = torch.nn.Linear(2, 2)
    state, _ = _state(model, torch.optim.Adam(model.parameters()))
    saved = state.state_dict()
    assert set(saved) == {"model", "optim", "elastic"}
    blob = pickle.loads(saved["elastic"])
    assert blob["world_size"] == 1 and len(blob["rng"]) == 1 and blob["tracked"] == {"counter": {"count": 0}}
    assert state.template()["elastic"] == b""  # filled by the load


def test_rank_takes_saved_stream_rank_mod_world():
    streams = []
    for seed in (10, 11):  # two ranks' streams, as gathered at save time
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        streams.append(capture_rng())
    saved = TrainingState(0, 2, gather=lambda world: streams).state_dict()
    random.seed(0), np.random.seed(0), torch.manual_seed(0)

    TrainingState(3, 4).load_state_dict(saved)  # 4 ranks now: rank 3 continues saved stream 3 % 2 == 1
    restored = _draws()
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    assert restored == _draws()


def test_only_parameters_and_optimizer_state_may_be_copied_late():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train_step_bn = lambda: (model(torch.randn(4, 2)).sum().backward(), optimizer.step())
    _train_step_bn()
    state, _ = _state(model, optimizer)
    late = state.changed_only_by_optimizer()
    assert late(model[0].weight) and late(optimizer.state[model[0].weight]["momentum_buffer"])
    assert not late(model[1].running_mean)  # forward updates it: staged before the save returns
    assert TrainingState(0, 1).changed_only_by_optimizer() is None
