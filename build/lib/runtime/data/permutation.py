"""A random permutation of ``[0, n)`` computed index by index, in constant memory.

A shuffled order that is materialized costs every rank ``O(n)`` time and memory per data epoch,
however few of the ``n`` examples the rank reads; at hundreds of ranks that is most of a rank's
work. :class:`IndexPermutation` maps any index on its own: a rank computes the positions it reads
and nothing else.

It is a Feistel network over the smallest power of four at least ``n``, with a round function
drawn from splitmix64; an output at or past ``n`` is fed back in until it lands inside (cycle
walking), which keeps the map a bijection of ``[0, n)``. The domain is less than ``4 n``, so a
few rounds of walking suffice on average.
"""

from __future__ import annotations

from typing import Any, final

import numpy as np
import torch
import xxhash
from torch import Tensor

_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


@final
class IndexPermutation:
    """A bijection of ``[0, size)`` drawn from ``seed``: the same seed gives the same order."""

    def __init__(self, size: int, *, seed: int) -> None:
        if size < 1:
            raise ValueError(f"size must be greater than zero, but is {size} instead.")
        self.size = size
        bits = max(2, (size - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        seeds = np.arange(_ROUNDS, dtype=np.uint64) + np.uint64(seed % (1 << 64))
        self._keys = _splitmix64(_splitmix64(seeds))

    def __call__(self, indices: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        """The positions ``indices`` (each in ``[0, size)``) map to, as int64."""
        values = np.asarray(indices, dtype=np.uint64)
        if values.size and int(values.max()) >= self.size:
            raise IndexError(f"An index is out of range: the permutation has {self.size}.")
        result = self._network(values)
        outside = np.flatnonzero(result >= self.size)
        while outside.size:
            result[outside] = self._network(result[outside])
            outside = outside[result[outside] >= self.size]
        return result.astype(np.int64)

    def _network(self, values: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        with np.errstate(over="ignore"):
            left, right = values >> self._half, values & self._mask
            for key in self._keys:
                left, right = right, left ^ (_splitmix64(right ^ key) & self._mask)
        result: np.ndarray[Any, Any] = (left << self._half) | right
        return result


@final
class ShuffledOrder:
    """Data epoch ``e``'s order of ``size`` examples: an :class:`IndexPermutation` drawn from the
    seed and ``e``. Give it to :class:`~runtime.data.MapDataReader` as ``order`` to shuffle
    without materializing the permutation on every rank."""

    def __init__(self, size: int, *, seed: int) -> None:
        self._size = size
        self._seed = seed

    def __call__(self, epoch: int, positions: Tensor) -> Tensor:
        """The examples at ``positions`` of epoch ``epoch``'s order."""
        epoch_seed = xxhash.xxh3_64_intdigest(f"{self._seed}/{epoch}".encode())
        order = IndexPermutation(self._size, seed=epoch_seed)
        return torch.from_numpy(order(positions.numpy()))
