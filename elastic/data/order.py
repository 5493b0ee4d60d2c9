"""Keyed permutations of range(n) in O(1) memory: the shuffled order of an epoch without a per-sample array.

`torch.randperm(n)` costs 8 bytes a sample and O(n) time at every epoch start and every restart: ~7.6 GB and
~60 s per rank at n = 1e9. A keyed bijection computes any position's index on its own instead: a balanced
Feistel network over the smallest power-of-four domain >= n, with cycle-walking back into [0, n) (the
construction of Grain's index_shuffle and of format-preserving encryption). The state is the key; a slice of
positions costs time proportional to its length, so a resume at position 7e8 starts as fast as one at 0.

The round function is a 64-bit integer mix (splitmix64's finalizer) of the half-block and a per-round key,
computed on numpy uint64 arrays, so a batch's indices come in one vectorized pass (plus a few passes for the
positions that walk). It shuffles for training, not for secrecy.
"""

from __future__ import annotations

import hashlib

import numpy as np

ROUNDS = 6  # Luby-Rackoff needs 4 for a pseudorandom permutation; 6 leaves no visible structure at small n


def _mix(values: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64's finalizer of (value + key): a 64-bit avalanche, vectorized (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = values + key
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def round_keys(seed: int, purpose: str, rounds: int = ROUNDS) -> list[int]:
    """Per-round keys from a stable hash of (purpose, seed): the same in every process, host and run."""
    digest = hashlib.blake2b(f"elastic.order.{purpose}:{seed}".encode(), digest_size=8 * rounds).digest()
    return [int.from_bytes(digest[8 * i : 8 * i + 8], "little") for i in range(rounds)]


class KeyedPermutation:
    """A bijection of range(n) chosen by `keys` (see round_keys). `at(positions)` maps positions to indices;
    `inverse(indices)` maps them back. Memory: the keys, whatever n is."""

    def __init__(self, n: int, keys: list[int]):
        if n < 0:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        # The domain is 2^(2*half) >= n, split into two halves of `half` bits; at least one bit each.
        self._half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self._half_mask = np.uint64((1 << self._half) - 1)
        self._keys = [np.uint64(k) for k in keys]

    def at(self, positions) -> np.ndarray:
        """The indices at `positions` (ints in [0, n)), as int64."""
        x = np.asarray(positions, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} is outside a permutation of {self.n}")
        return self._walk(x, self._encrypt).astype(np.int64)

    def inverse(self, indices) -> np.ndarray:
        """The positions of `indices` (the inverse permutation), as int64."""
        x = np.asarray(indices, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"index {int(x.max())} is outside a permutation of {self.n}")
        return self._walk(x, self._decrypt).astype(np.int64)

    def slice(self, start: int, stop: int) -> np.ndarray:
        """The indices at positions start..stop-1."""
        return self.at(np.arange(start, stop, dtype=np.uint64))

    def _walk(self, x: np.ndarray, cipher) -> np.ndarray:
        # Cycle-walking: a value the cipher sends outside [0, n) is enciphered again until it lands inside.
        # The domain is < 4n, so each value walks about 4 times at worst (geometric), and the walk of a
        # value inside [0, n) stays a bijection on [0, n).
        out = cipher(x)
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = cipher(out[outside])
            outside = out >= np.uint64(self.n)
        return out

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self._half), x & self._half_mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right, key) & self._half_mask)
        return (left << np.uint64(self._half)) | right

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(self._half), x & self._half_mask
        for key in reversed(self._keys):
            left, right = right ^ (_mix(left, key) & self._half_mask), left
        return (left << np.uint64(self._half)) | right
