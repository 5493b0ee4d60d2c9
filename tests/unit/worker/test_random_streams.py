"""Exact random streams across a resume (no Ray): the loader never touches the global stream, augmentation in
DataLoader workers is a function of (seed, epoch, sample), verify-resume names the first divergent step, and
chaos notices arrive once."""

from __future__ import annotations

import random

import fsspec
import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from elastic.checkpoint.store import CheckpointStore
from elastic.data import ResumableLoader, ResumableSampler, sample_seed
from elastic.diagnostics.verify import kill_points
from elastic.worker.audit import History, StepRecord, first_divergence
from elastic.worker.chaos import Chaos, Kill
from elastic.worker.jit import Notice
from elastic.worker.training_state import capture_rng, restore_rng


class Augmented(Dataset):
    """Random crop-like jitter from torch, a flip from python's random and noise from numpy: every stream."""

    def __init__(self, size: int = 24):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        shift = torch.randint(0, 100, (1,)).item()
        flip = random.random() < 0.5
        noise = float(np.random.normal())
        return torch.tensor([index, shift, int(flip), noise], dtype=torch.float64)


def _loader(rank=0, world=1, num_workers=0, state=None, **kwargs) -> ResumableLoader:
    sampler = ResumableSampler(24, 4, rank, world, seed=7)
    if state is not None:
        sampler.load_state_dict(state)
    return ResumableLoader(Augmented(), sampler, num_workers=num_workers, **kwargs)


def _run(loader: ResumableLoader, epochs: int, stop_after: int | None = None) -> list[torch.Tensor]:
    batches = []
    for _, batch in loader.epochs(epochs):
        batches.append(batch)
        if stop_after is not None and len(batches) == stop_after:
            break
    return batches


def test_making_an_iterator_leaves_the_global_torch_stream_alone():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    loader = _loader()
    iterator = iter(loader)
    assert torch.equal(torch.get_rng_state(), before)  # PyTorch's own DataLoader would draw a base seed here
    next(iterator)
    # num_workers=0: the dataset itself draws from the global stream, as the user's code asked
    assert not torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("persistent", [False, True])
def test_augmentation_in_two_workers_resumes_mid_epoch_exactly(persistent):
    options = {"num_workers": 2, "persistent_workers": persistent}
    whole = _run(_loader(**options), epochs=2)
    first = _loader(**options)
    head = _run(first, epochs=2, stop_after=8)  # 6 batches an epoch: stops 2 into the second epoch
    tail = _run(_loader(state=first.state_dict(), **options), epochs=2)
    assert len(head) + len(tail) == len(whole) == 12
    for expected, got in zip(whole, head + tail):
        assert torch.equal(expected, got)


def test_augmentation_of_a_sample_is_the_same_at_any_worker_count_and_num_workers():
    def by_sample(batches):
        rows = torch.cat(batches)
        return {int(row[0]): row for row in rows}

    one_rank = by_sample(_run(_loader(num_workers=2), epochs=1))
    two_ranks = {}
    for rank in range(2):
        two_ranks.update(by_sample(_run(_loader(rank=rank, world=2, num_workers=1), epochs=1)))
    assert one_rank.keys() == two_ranks.keys() == set(range(24))
    assert all(torch.equal(one_rank[i], two_ranks[i]) for i in one_rank)
    # and another epoch augments the same sample differently
    epoch_1 = by_sample(
        _run(
            _loader(num_workers=2, state={"epoch": 1, "consumed": 0, "seed": 7, "num_samples": 24, "shuffle": True}),
            epochs=2,
        )
    )
    assert any(not torch.equal(one_rank[i], epoch_1[i]) for i in one_rank)
    assert sample_seed(7, 0, 3) != sample_seed(7, 1, 3) != sample_seed(8, 0, 3)


def test_main_process_augmentation_resumes_exactly_with_the_saved_streams():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    whole = _run(_loader(), epochs=2)
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    first = _loader()
    head = _run(first, epochs=2, stop_after=5)
    state, streams = first.state_dict(), capture_rng()
    torch.manual_seed(99), random.seed(99), np.random.seed(99)  # a fresh process: other streams...
    resumed = _loader(state=state)
    restore_rng(streams)  # ...until the session restores the checkpoint's
    tail = _run(resumed, epochs=2)
    for expected, got in zip(whole, head + tail, strict=True):
        assert torch.equal(expected, got)


def test_the_loader_owns_its_generator():
    with pytest.raises(ValueError, match="owns its generator"):
        _loader(generator=torch.Generator())


def _history(losses: dict[int, float], attempt_of: dict[int, str], resumed: dict[str, int]) -> History:
    history = History(resumed_from=dict(resumed), attempts=sorted(resumed))
    for step, loss in losses.items():
        history.steps[step] = StepRecord(step, attempt_of.get(step, "a"), 1, {0: []}, {0: loss})
    return history


def test_first_divergence_names_the_step_and_the_checkpoint_resumed_from():
    base = _history({1: 2.0, 2: 1.5, 3: 1.2, 4: 1.0}, {}, {"a": 0})
    same = _history({1: 2.0, 2: 1.5, 3: 1.2, 4: 1.0}, {3: "b", 4: "b"}, {"a": 0, "b": 2})
    assert first_divergence(base, same) is None
    off = _history({1: 2.0, 2: 1.5, 3: 1.2, 4: 1.1}, {3: "b", 4: "b"}, {"a": 0, "b": 2})
    found = first_divergence(base, off)
    assert found is not None and found.step == 4 and found.resumed_from == 2
    assert "step 4 (resumed from the checkpoint of step 2; rank 0: 1.1 against 1.0)" == str(found)
    nan = _history({1: float("nan")}, {}, {"a": 0})
    assert first_divergence(nan, _history({1: float("nan")}, {}, {"a": 0})) is None
    # A step with no loss recorded on one side (a Trainer logs every few steps) is not compared; the next is.
    gap = _history({1: 2.0, 2: None, 3: 1.3, 4: 1.0}, {2: "b", 3: "b", 4: "b"}, {"a": 0, "b": 1})
    assert first_divergence(base, gap).step == 3


def test_kill_points_place_notices_between_kills_and_never_in_a_save():
    points = kill_points(3, 1, notices=1)
    assert [p.notice for p in points] == [False, True, False, False]
    assert [p.during_save for p in points if not p.notice] == [False, True, False]
    assert [p.fraction for p in points] == [0.2, 0.4, 0.6, 0.8]
    assert not any(p.ends_segment for p in points)
    assert [p.notice for p in kill_points(2, 1, notices=0)] == [False, False]
    assert sum(p.ends_segment for p in kill_points(4, 3, notices=1) if not p.notice) == 2


def test_a_chaos_notice_arrives_at_its_step_once_and_stays_until_handled(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"))
    ray_mark = Notice(deadline=5.0, node_ids=("ray",))
    chaos = Chaos(store, 0, [Kill(3, 0, notice=True)])
    read = chaos.notice_source(lambda: None)
    chaos.maybe_kill(2)
    assert read() is None
    chaos.maybe_kill(3)
    notice = read()
    assert notice is not None and notice.deadline is None
    chaos.maybe_kill(4)
    assert read() is notice  # the just-in-time planner polls until it has planned
    # a restart that replays step 3 does not get it again
    again = Chaos(store, 0, [Kill(3, 0, notice=True)])
    read_again = again.notice_source(lambda: ray_mark)
    again.maybe_kill(3)
    assert read_again() is ray_mark
    assert fsspec.filesystem("file").exists(f"{store.root}/chaos/notice-3-rank-0")
    # without planned notices Ray's mark is read as it is
    plain = Chaos(store, 0, [])
    assert plain.notice_source(lambda: ray_mark)() is ray_mark
