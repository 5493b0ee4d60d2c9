"""Unit tests for elastic/data/loader.py: exactly-once, resumable, resizable data loading (no Ray, local files only).

W ranks are simulated in one process: W loaders over the same dataset, stepped in lockstep as DDP would.
"""

from __future__ import annotations

import pickle
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from elastic.data import ParquetDataset, ResumableLoader, ResumableSampler, epoch_order

N, B = 103, 4  # N is not a multiple of W*B for any W used here


# ---------------------------------------------------------------------------------------------------------
# helpers


def make_loaders(
    dataset: Dataset, world: int, batch: int = B, seed: int = 0, num_workers: int = 0, **sampler_kwargs
) -> list[ResumableLoader]:
    return [
        ResumableLoader(
            dataset,
            ResumableSampler(len(dataset), batch, rank, world, seed=seed, **sampler_kwargs),
            num_workers=num_workers,
        )
        for rank in range(world)
    ]


def indices_of(batch) -> list[int]:
    """Sample ids in a batch: TensorDataset batches are [tensor], Parquet batches are {'id': tensor, ...}."""
    ids = batch["id"] if isinstance(batch, dict) else batch[0]
    return [int(i) for i in ids]


def run(loaders: Sequence[ResumableLoader], steps: int | None = None) -> list[list[list[int]]]:
    """Step the ranks in lockstep for `steps` steps (None: to the end of the epoch); per rank, its batches.

    Also checks what must hold on every step: every rank has a batch (same step count) and the same state.
    """
    iterators = [iter(loader) for loader in loaders]
    seen: list[list[list[int]]] = [[] for _ in loaders]
    taken = 0
    while steps is None or taken < steps:
        batches = [next(it, None) for it in iterators]
        if all(batch is None for batch in batches):
            break
        assert all(batch is not None for batch in batches), "ranks disagree on the number of steps"
        for rank, batch in enumerate(batches):
            seen[rank].append(indices_of(batch))
        states = [loader.state_dict() for loader in loaders]
        assert all(state == states[0] for state in states), states
        taken += 1
    if steps is not None:
        assert taken == steps, f"epoch ended after {taken} of {steps} steps"
    return seen


def flat(seen: list[list[list[int]]]) -> list[int]:
    return [i for rank in seen for batch in rank for i in batch]


def assert_exactly_once(indices: list[int], n: int = N) -> None:
    counts = Counter(indices)
    repeated = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not repeated and not missing, f"repeated {repeated[:10]}, missing {missing[:10]}"
    assert len(indices) == n


@pytest.fixture
def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(N))


# ---------------------------------------------------------------------------------------------------------
# (1) one epoch covers every index exactly once


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_one_epoch_is_exactly_once(dataset, world):
    loaders = make_loaders(dataset, world)
    assert len(loaders[0]) == -(-N // (world * B))
    seen = run(loaders)
    assert_exactly_once(flat(seen))
    # the global order is the world-size independent permutation, read in global batches of W*B
    steps = len(seen[0])
    global_sequence = [i for step in range(steps) for rank in range(world) for i in seen[rank][step]]
    assert global_sequence == epoch_order(N, 0, 0).tolist()
    assert loaders[0].state_dict() == {
        "epoch": 1,
        "consumed": 0,
        "seed": 0,
        "num_samples": N,
        "shuffle": True,
        "order": 2,
    }


def test_tail_is_split_evenly_in_rank_order(dataset):
    seen = run(make_loaders(dataset, 2))
    # 103 = 12 * 8 + 7: the last step gives 4 and 3 samples, every earlier one 4 and 4
    assert [len(b) for b in seen[0]] == [4] * 12 + [4]
    assert [len(b) for b in seen[1]] == [4] * 12 + [3]


def test_shuffle_false_reads_in_order(dataset):
    seen = run(make_loaders(dataset, 2, shuffle=False))
    assert seen[0][0] == [0, 1, 2, 3] and seen[1][0] == [4, 5, 6, 7]
    assert seen[1][-1] == [100, 101, 102]


# ---------------------------------------------------------------------------------------------------------
# (2) + (3) interrupt, resume at the same or another world size


@pytest.mark.parametrize("world,new_world", [(2, 1), (1, 2), (2, 3), (3, 2), (2, 2), (3, 5)])
@pytest.mark.parametrize("steps_before", [1, 5])
def test_resume_at_another_world_size_is_exactly_once(dataset, world, new_world, steps_before):
    loaders = make_loaders(dataset, world, seed=7)
    before = run(loaders, steps_before)
    state = loaders[0].state_dict()
    assert state["consumed"] == steps_before * world * B

    resumed = make_loaders(dataset, new_world, seed=7)
    for loader in resumed:
        loader.load_state_dict(state)
    after = run(resumed)

    assert_exactly_once(flat(before) + flat(after))
    # and the global stream continues where it stopped: the same permutation, read in order
    order = epoch_order(N, 7, 0).tolist()
    after_sequence = [i for step in range(len(after[0])) for rank in range(new_world) for i in after[rank][step]]
    assert after_sequence == order[steps_before * world * B :]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_at_same_world_size_is_bit_identical(dataset, world):
    uninterrupted = run(make_loaders(dataset, world, seed=3))

    pieces: list[list[list[int]]] = [[] for _ in range(world)]
    state = None
    for steps in (2, 3, 1, None):  # three interruptions, fresh loaders each time
        loaders = make_loaders(dataset, world, seed=3)
        if state is not None:
            for loader in loaders:
                loader.load_state_dict(state)
        part = run(loaders, steps)
        for rank in range(world):
            pieces[rank] += part[rank]
        state = loaders[0].state_dict()

    assert pieces == uninterrupted


def test_state_does_not_depend_on_rank_or_batch_size_to_restore(dataset):
    loaders = make_loaders(dataset, 2, batch=4)
    before = run(loaders, 3)
    resumed = make_loaders(dataset, 3, batch=5)  # both the world size and the per-rank batch change
    for loader in resumed:
        loader.load_state_dict(loaders[1].state_dict())  # any rank's copy will do
    assert_exactly_once(flat(before) + flat(run(resumed)))


# ---------------------------------------------------------------------------------------------------------
# (4) prefetching workers do not move the state


class CountingSampler(ResumableSampler):
    """Counts how many batches the DataLoader has pulled (prefetched) from the sampler."""

    pulled = 0

    def pending(self):
        for batch in super().pending():
            self.pulled += 1
            yield batch


def test_prefetching_workers_do_not_advance_the_state(dataset):
    world, steps = 2, 2
    samplers = [CountingSampler(N, B, rank, world, seed=1) for rank in range(world)]
    loaders = [ResumableLoader(dataset, s, num_workers=2, prefetch_factor=3) for s in samplers]
    before = run(loaders, steps)

    # the DataLoader really did read ahead of what we received (2 workers x 3 batches in flight)...
    assert all(sampler.pulled > steps for sampler in samplers)
    # ...yet the state holds exactly the batches received
    state = loaders[0].state_dict()
    assert state["consumed"] == steps * world * B
    assert len(loaders[0]) == -(-N // (world * B)) - steps

    resumed = make_loaders(dataset, 3, seed=1, num_workers=2)
    for loader in resumed:
        loader.load_state_dict(state)
    assert_exactly_once(flat(before) + flat(run(resumed)))


def test_direct_sampler_iteration_advances_on_yield():
    sampler = ResumableSampler(10, 3, 0, 1, seed=0)
    iterator = iter(sampler)
    first = next(iterator)
    assert sampler.state_dict()["consumed"] == 3
    rest = list(iterator)
    assert sorted(first + [i for b in rest for i in b]) == list(range(10))
    assert sampler.state_dict()["epoch"] == 1 and sampler.state_dict()["consumed"] == 0


def test_pending_does_not_move_the_position():
    sampler = ResumableSampler(10, 3, 0, 2, seed=0)
    assert len(list(sampler.pending())) == 2
    assert sampler.position == (0, 0)


def test_changing_state_mid_iteration_is_an_error(dataset):
    loader = make_loaders(dataset, 1)[0]
    iterator = iter(loader)
    next(iterator)
    loader.set_epoch(4)
    with pytest.raises(RuntimeError, match="changed during iteration"):
        next(iterator)


# ---------------------------------------------------------------------------------------------------------
# (5) epochs


def test_each_epoch_has_its_own_permutation_fixed_by_the_seed():
    orders = [epoch_order(N, 0, epoch).tolist() for epoch in range(3)]
    assert all(sorted(order) == list(range(N)) for order in orders)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert orders == [epoch_order(N, 0, epoch).tolist() for epoch in range(3)]
    assert epoch_order(N, 1, 0).tolist() != orders[0]


def test_epochs_run_in_order_and_each_is_exactly_once(dataset):
    loaders = make_loaders(dataset, 2, seed=5)
    per_epoch: dict[int, list[int]] = {}
    for steps in zip(*(loader.epochs(3) for loader in loaders), strict=True):
        epochs = {epoch for epoch, _ in steps}
        assert len(epochs) == 1
        per_epoch.setdefault(epochs.pop(), []).extend(i for _, batch in steps for i in indices_of(batch))
    assert sorted(per_epoch) == [0, 1, 2]
    for indices in per_epoch.values():
        assert_exactly_once(indices)
    assert per_epoch[0] != per_epoch[1]
    assert loaders[0].state_dict()["epoch"] == 3
    assert list(loaders[0].epochs(3)) == []


def test_resume_at_an_epoch_boundary(dataset):
    loaders = make_loaders(dataset, 2, seed=2)
    run(loaders)  # all of epoch 0
    state = loaders[0].state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)

    resumed = make_loaders(dataset, 3, seed=2)
    for loader in resumed:
        loader.load_state_dict(state)
    epoch1 = run(resumed)
    assert_exactly_once(flat(epoch1))
    assert [i for s in range(len(epoch1[0])) for r in range(3) for i in epoch1[r][s]] == epoch_order(N, 2, 1).tolist()


def test_epochs_resumes_mid_epoch_across_a_resize(dataset):
    """Save mid-epoch 1 at W=3, finish with epochs() at W=2: every epoch exactly once."""
    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    loaders = make_loaders(dataset, 3, seed=9)
    iterators = [loader.epochs(3) for loader in loaders]
    for _ in range(9 + 4):  # epoch 0 has ceil(103 / 12) = 9 steps; stop 4 steps into epoch 1
        for epoch, batch in (next(it) for it in iterators):
            seen[epoch].extend(indices_of(batch))
    state = loaders[0].state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 4 * 12)

    resumed = make_loaders(dataset, 2, seed=9)
    for loader in resumed:
        loader.load_state_dict(state)
    for steps in zip(*(loader.epochs(3) for loader in resumed), strict=True):
        for epoch, batch in steps:
            seen[epoch].extend(indices_of(batch))
    for indices in seen.values():
        assert_exactly_once(indices)


def test_set_epoch_keeps_a_restored_position_and_resets_on_a_new_epoch():
    sampler = ResumableSampler(N, B, 0, 1)
    sampler.load_state_dict({"epoch": 2, "consumed": 40, "seed": 0, "num_samples": N, "shuffle": True})
    sampler.set_epoch(2)
    assert sampler.position == (2, 40)
    sampler.set_epoch(3)
    assert sampler.position == (3, 0)


# ---------------------------------------------------------------------------------------------------------
# (6) state validation


@pytest.mark.parametrize("key,value", [("num_samples", N + 1), ("seed", 1), ("shuffle", False)])
def test_load_state_dict_rejects_a_mismatch_naming_it(key, value):
    state = ResumableSampler(N, B, 0, 2).state_dict()
    state[key] = value
    sampler = ResumableSampler(N, B, 0, 2)
    with pytest.raises(ValueError, match=key):
        sampler.load_state_dict(state)
    assert sampler.position == (0, 0)


def test_load_state_dict_rejects_missing_and_out_of_range_values():
    sampler = ResumableSampler(N, B, 0, 2)
    with pytest.raises(ValueError, match="missing consumed"):
        sampler.load_state_dict({"epoch": 0, "seed": 0, "num_samples": N, "shuffle": True})
    with pytest.raises(ValueError, match="out of range"):
        sampler.load_state_dict({"epoch": 0, "consumed": N + 1, "seed": 0, "num_samples": N, "shuffle": True})


def test_bad_arguments_are_rejected(dataset):
    with pytest.raises(ValueError, match="rank"):
        ResumableSampler(N, B, 2, 2)
    with pytest.raises(ValueError, match="batch_size"):
        ResumableSampler(N, 0, 0, 1)
    with pytest.raises(ValueError, match="samples"):
        ResumableLoader(dataset, ResumableSampler(N + 1, B, 0, 1))


# ---------------------------------------------------------------------------------------------------------
# (7) a tail smaller than the world size, and drop_last


def test_tail_smaller_than_world_gives_empty_batches_and_stays_exactly_once():
    n, world, batch = 2 * 3 * 2 + 2, 3, 2  # two full steps of 6, then 2 samples for 3 ranks
    dataset = TensorDataset(torch.arange(n))
    loaders = make_loaders(dataset, world, batch=batch, num_workers=1)
    iterators = [iter(loader) for loader in loaders]
    steps = list(zip(*iterators, strict=True))
    last = steps[-1]
    assert [len(b[0]) for b in last] == [1, 1, 0]
    # the empty batch keeps the structure of a real one: [tensor of shape (0,)] with the right dtype
    assert isinstance(last[2], list) and last[2][0].shape == (0,) and last[2][0].dtype == torch.int64
    assert_exactly_once([i for step in steps for b in step for i in indices_of(b)], n)


def test_resume_into_a_tail_smaller_than_the_new_world_size():
    n = 11
    dataset = TensorDataset(torch.arange(n))
    loaders = make_loaders(dataset, 1, batch=3)
    before = run(loaders, 3)  # 9 consumed, 2 left
    resumed = make_loaders(dataset, 4, batch=3)
    for loader in resumed:
        loader.load_state_dict(loaders[0].state_dict())
    after = run(resumed)
    assert [len(rank[0]) for rank in after] == [1, 1, 0, 0]
    assert_exactly_once(flat(before) + flat(after), n)


def test_empty_batch_keeps_dict_structure():
    class Rows(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"x": torch.full((2,), float(i)), "name": f"row{i}", "id": i}

    loaders = make_loaders(Rows(), 4, batch=1)
    batches = [next(iter(loader)) for loader in loaders]
    empty = batches[3]
    assert set(empty) == {"x", "name", "id"}
    assert empty["x"].shape == (0, 2) and empty["name"] == [] and empty["id"].shape == (0,)


def test_drop_last_drops_the_partial_tail(dataset):
    loaders = make_loaders(dataset, 2, drop_last=True)
    seen = run(loaders)
    indices = flat(seen)
    # 12 full global batches of 8; the 7-sample tail is dropped, and nothing is repeated
    assert len(indices) == 96 and len(set(indices)) == 96
    assert all(len(b) == B for rank in seen for b in rank)
    assert [i for s in range(12) for r in range(2) for i in seen[r][s]] == epoch_order(N, 0, 0).tolist()[:96]
    assert (loaders[0].state_dict()["epoch"], loaders[0].state_dict()["consumed"]) == (1, 0)


def test_drop_last_resume_with_less_than_a_global_batch_left_rolls_over(dataset):
    loaders = make_loaders(dataset, 1, drop_last=True)
    run(loaders, 24)  # 96 consumed, 7 left: not a whole global batch of 8 at W=2
    resumed = make_loaders(dataset, 2, drop_last=True)
    for loader in resumed:
        loader.load_state_dict(loaders[0].state_dict())
    assert len(resumed[0]) == 0
    assert run(resumed) == [[], []]
    assert resumed[0].state_dict()["epoch"] == 1


def test_empty_dataset_has_no_batches():
    loaders = make_loaders(TensorDataset(torch.arange(0)), 2)
    assert run(loaders) == [[], []]
    assert loaders[0].epoch == 1


# ---------------------------------------------------------------------------------------------------------
# (8) Parquet


ROW_GROUPS = [(7, 30), (13, 41), (50, 32)]  # (row group size, rows) per shard: uneven on purpose


def expected_rows() -> list[dict]:
    rows, next_id = [], 0
    for _, count in ROW_GROUPS:
        for _ in range(count):
            i = next_id
            rows.append({"id": i, "value": i * 0.5, "name": f"row-{i}", "tokens": list(range(i % 5))})
            next_id += 1
    return rows


def write_shards(directory, rows: list[dict]) -> list[str]:
    """Shards part-0 .. part-2 (ids ascending across them), each with its own row-group size."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, start = [], 0
    for shard, (group_size, count) in enumerate(ROW_GROUPS):
        chunk = rows[start : start + count]
        start += count
        table = pa.table(
            {
                "id": pa.array([r["id"] for r in chunk], pa.int64()),
                "value": pa.array([r["value"] for r in chunk], pa.float64()),
                "name": pa.array([r["name"] for r in chunk], pa.string()),
                "tokens": pa.array([r["tokens"] for r in chunk], pa.list_(pa.int32())),
            }
        )
        path = directory / f"part-{shard}.parquet"
        pq.write_table(table, path, row_group_size=group_size)
        paths.append(str(path))
    (directory / "_SUCCESS").write_text("")  # not Parquet: must be skipped by directory listing
    return paths


@pytest.fixture
def parquet_dir(tmp_path):
    write_shards(tmp_path / "data", expected_rows())
    return tmp_path / "data"


def assert_row(item: dict, row: dict) -> None:
    assert item["id"] == row["id"] and isinstance(item["id"], np.integer)
    assert item["value"] == row["value"]
    assert item["name"] == row["name"]
    assert isinstance(item["tokens"], np.ndarray) and item["tokens"].tolist() == row["tokens"]


def test_parquet_reads_every_row_by_index(parquet_dir):
    rows = expected_rows()
    dataset = ParquetDataset(str(parquet_dir))
    assert len(dataset) == len(rows) == 103
    assert [f.rsplit("/", 1)[-1] for f in dataset.files] == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    for i in range(len(rows)):
        assert_row(dataset[i], rows[i])
    # random order too (crosses row groups and files, evicting the small cache)
    for i in torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)).tolist():
        assert_row(dataset[i], rows[i])
    assert_row(dataset[-1], rows[-1])
    with pytest.raises(IndexError):
        dataset[len(rows)]


@pytest.mark.parametrize("form", ["list", "file-uri", "glob"])
def test_parquet_sources_are_sorted_the_same_way(parquet_dir, form):
    files = sorted(str(p) for p in parquet_dir.glob("*.parquet"))
    source = {
        "list": list(reversed(files)),
        "file-uri": f"file://{parquet_dir}",
        "glob": str(parquet_dir / "part-*.parquet"),
    }[form]
    dataset = ParquetDataset(source)
    assert [f.rsplit("/", 1)[-1] for f in dataset.files] == [p.rsplit("/", 1)[-1] for p in files]
    assert [int(dataset[i]["id"]) for i in range(len(dataset))] == list(range(103))


def test_parquet_columns_transform_and_errors(parquet_dir, tmp_path):
    dataset = ParquetDataset(str(parquet_dir), columns=["id", "name"], transform=lambda r: (int(r["id"]), r["name"]))
    assert dataset[42] == (42, "row-42")
    with pytest.raises(ValueError, match="missing_column"):
        ParquetDataset(str(parquet_dir), columns=["id", "missing_column"])
    with pytest.raises(FileNotFoundError):
        ParquetDataset(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no Parquet files"):
        ParquetDataset(str(tmp_path / "empty"))


def test_parquet_dataset_pickles_without_open_files(parquet_dir):
    dataset = ParquetDataset(str(parquet_dir))
    dataset[5]  # opens a file and caches a row group in this process
    clone = pickle.loads(pickle.dumps(dataset))
    assert not clone._open and not clone._cache
    assert_row(clone[99], expected_rows()[99])


@pytest.mark.parametrize("world,new_world", [(2, 1), (1, 3), (3, 2)])
def test_parquet_resume_across_world_sizes_is_exactly_once(parquet_dir, world, new_world):
    dataset = ParquetDataset(str(parquet_dir), columns=["id", "value"])
    loaders = make_loaders(dataset, world, seed=11, num_workers=2)
    before = run(loaders, 4)
    resumed = make_loaders(ParquetDataset(str(parquet_dir), columns=["id", "value"]), new_world, seed=11, num_workers=2)
    for loader in resumed:
        loader.load_state_dict(loaders[0].state_dict())
    after = run(resumed)
    assert_exactly_once(flat(before) + flat(after), len(dataset))
