"""Unit tests for elastic/data/order.py and the sampler's order versions: a keyed permutation is a bijection
for every n (small and odd sizes included), its inverse undoes it, it costs no per-sample memory (a slice far
into a 1e9-row epoch comes at once), it looks shuffled, and a position saved before order versions existed
resumes in torch.randperm's order."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic.data.order import KeyedPermutation, round_keys
from elastic.data.sampler import ResumableSampler, epoch_order


@given(n=st.integers(0, 5000), seed=st.integers(0, 2**32))
@settings(max_examples=60, deadline=None)
def test_every_size_is_a_bijection_and_the_inverse_undoes_it(n, seed):
    perm = KeyedPermutation(n, round_keys(seed, "test"))
    indices = perm.slice(0, n)
    assert sorted(indices.tolist()) == list(range(n))
    assert perm.inverse(indices).tolist() == list(range(n))


def test_slices_agree_with_the_whole_and_positions_outside_are_refused():
    perm = KeyedPermutation(1000, round_keys(3, "test"))
    whole = perm.slice(0, 1000)
    assert perm.slice(250, 260).tolist() == whole[250:260].tolist()
    assert perm.at([999, 0]).tolist() == [whole[999], whole[0]]
    with pytest.raises(IndexError):
        perm.at([1000])


def test_keys_decide_the_order_and_it_looks_shuffled():
    n = 10_000
    a = KeyedPermutation(n, round_keys(1, "test")).slice(0, n)
    b = KeyedPermutation(n, round_keys(2, "test")).slice(0, n)
    assert (a != b).mean() > 0.99
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05  # no trend left from the identity
    fixed = (a == np.arange(n)).sum()
    assert fixed < 10  # a random permutation has ~1 fixed point
    # Neighbouring positions land far apart (a block shuffle would keep runs together).
    assert np.median(np.abs(np.diff(a))) > n / 10


def test_a_slice_deep_in_a_billion_rows_needs_no_per_sample_memory():
    perm = KeyedPermutation(10**9, round_keys(0, "test"))
    tracemalloc.start()
    batch = perm.slice(7 * 10**8, 7 * 10**8 + 4096)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(set(batch.tolist())) == 4096 and batch.max() < 10**9
    assert peak < 2 * 1024 * 1024  # a few arrays of 4096 words, not 8 GB


def test_a_position_saved_without_an_order_version_resumes_in_randperms_order():
    n, batch = 100, 10
    old_state = {"epoch": 0, "consumed": 30, "seed": 5, "num_samples": n, "shuffle": True}
    sampler = ResumableSampler(n, batch, 0, 1, seed=5)
    sampler.load_state_dict(old_state)
    assert next(sampler.pending()) == epoch_order(n, 5, 0, version=1)[30:40].tolist()
    assert sampler.state_dict()["order"] == 1  # and it stays in that order for the rest of the run
    fresh = ResumableSampler(n, batch, 0, 1, seed=5)
    assert fresh.state_dict()["order"] == 2
    assert next(fresh.pending()) == epoch_order(n, 5, 0).tolist()[:10]
    with pytest.raises(ValueError, match="order version 9"):
        fresh.load_state_dict({**old_state, "order": 9})
