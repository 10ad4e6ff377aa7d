"""A shuffle of any size whose positions are computed one by one: ShuffleSampler.

torch's RandomSampler draws ``randperm(n)``: to know any batch of an epoch,
the whole permutation is drawn first (O(n) time, 8 bytes a sample in every
process that needs a batch: 8 GB for 10^9 samples). ShuffleSampler's order
is a keyed bijection of ``[0, n)``, a balanced Feistel network on the
smallest even number of bits that covers ``n``, cycle-walked into range
(Black and Rogaway's "ciphers with arbitrary finite domains"): the index at
any position costs a few dozen integer operations, so the first batch of a
10^9-sample epoch comes as fast as that of 10^4, on a trainer's torch
DataLoader as on a Dpex worker. It is not torch's order: the same seed gives
the same order in both, not the order of RandomSampler.
"""
from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np

# The order's name. A described epoch carries it, and a worker that would
# compute another order refuses the description (a release that changes the
# order must change the name).
ALGORITHM = "feistel6-splitmix64"
_ROUNDS = 6
_CHUNK = 1 << 16  # positions computed at once while iterating
_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> tuple[int, int]:
    """(next state, output) of Steele et al.'s SplitMix64 generator, on Python ints."""
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Permutation:
    """A seeded bijection of ``range(length)``: ``self(positions)`` is the
    index at each position of the shuffled order."""

    def __init__(self, length: int, seed: int) -> None:
        if length < 0:
            raise ValueError(f"a permutation of {length} elements")
        self.length = length
        bits = max(2, (length - 1).bit_length())
        self._half = np.uint64((bits + 1) // 2)
        self._mask = np.uint64((1 << int(self._half)) - 1)
        state, keys = seed & _MASK64, []
        for _ in range(_ROUNDS):
            state, key = _splitmix64(state)
            keys.append(np.uint64(key))
        self._keys = keys

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        for key in self._keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << self._half) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        x = self._encrypt(np.asarray(positions, dtype=np.uint64))
        n = np.uint64(self.length)
        outside = np.flatnonzero(x >= n)
        while outside.size:  # cycle walking: the domain is < 4n, so a few steps at most, on average < 4
            x[outside] = self._encrypt(x[outside])
            outside = outside[x[outside] >= n]
        return x.astype(np.int64)


def num_samples(length: int, num_replicas: int, drop_last: bool) -> int:
    """One rank's samples per epoch, as DistributedSampler counts them."""
    if drop_last and length % num_replicas:
        return -(-(length - num_replicas) // num_replicas)
    return -(-length // num_replicas)


def positions(length: int, num_replicas: int, rank: int, start: int, stop: int) -> np.ndarray:
    """Where a rank's samples ``start`` .. ``stop - 1`` sit in the epoch's
    order, as DistributedSampler takes its share: its j-th is at ``rank + j *
    num_replicas``, wrapping around (padding) past the end."""
    return (np.arange(start, stop, dtype=np.int64) * num_replicas + rank) % max(length, 1)


def indices(length: int, seed: int, num_replicas: int, rank: int, start: int, stop: int) -> np.ndarray:
    """A rank's samples ``start`` .. ``stop - 1`` of the epoch: the indices at
    their :func:`positions` in the seed's order."""
    return Permutation(length, seed)(positions(length, num_replicas, rank, start, stop))


class ShuffleSampler:
    """Every sample once per epoch in a seeded order, its first batch as fast at 10^9 samples as at 10^4.

    See the module's notes.

    Use it where torch's ``RandomSampler`` or ``DistributedSampler`` would be
    too slow or too big to draw whole: ``RemoteDataLoader(spec, sampler=
    ShuffleSampler(len_of_dataset), batch_size=...)``, or in a torch DataLoader,
    which then yields the same batches. Like DistributedSampler, rank
    ``rank`` of ``num_replicas`` takes every ``num_replicas``-th sample,
    padded by wrapping around (or cut, ``drop_last``) to equal shares. With a
    ``seed``, epoch e's order is the seed's + e (call ``set_epoch``); without
    one, each ``iter()`` draws a seed from torch's global RNG, as RandomSampler
    does.

    Args:
        data_source: the dataset, or its length.
        seed: the order's seed; None: one drawn from torch's global RNG at each ``iter()`` (every rank must
            then seed torch alike).
        num_replicas: ranks sharing the epoch (more than one needs a ``seed``).
        rank: this rank's share.
        drop_last: cut the epoch to equal shares instead of padding by wrapping around.

    Raises:
        ValueError: a negative length, a rank outside ``num_replicas``, or replicas without a seed.
    """

    def __init__(self, data_source: Sized | int, *, seed: int | None = None, num_replicas: int = 1,
                 rank: int = 0, drop_last: bool = False) -> None:
        length = data_source if isinstance(data_source, int) else len(data_source)
        if length < 0:
            raise ValueError(f"ShuffleSampler of a dataset of length {length}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} of num_replicas {num_replicas}")
        if seed is None and num_replicas > 1:
            raise ValueError("ShuffleSampler with num_replicas > 1 needs a seed, the same on every rank")
        self.length, self.seed, self.num_replicas, self.rank = length, seed, num_replicas, rank
        self.drop_last, self.epoch = drop_last, 0

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next ``iter()`` yields (with a seed).

        Args:
            epoch: the epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return num_samples(self.length, self.num_replicas, self.drop_last)

    def epoch_seed(self) -> int:
        """The seed of the order the next ``iter()`` yields.

        Returns:
            The seed + epoch, or one drawn from torch's global RNG now (as ``iter()`` would)."""
        if self.seed is not None:
            return (self.seed + self.epoch) & _MASK64
        import torch
        return int(torch.empty((), dtype=torch.int64).random_().item())

    def __iter__(self) -> Iterator[int]:
        seed, total = self.epoch_seed(), len(self)
        for start in range(0, total, _CHUNK):
            yield from indices(self.length, seed, self.num_replicas, self.rank, start,
                               min(total, start + _CHUNK)).tolist()
