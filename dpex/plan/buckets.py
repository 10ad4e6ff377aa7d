"""Coordinated reads: each step's batches, across the ranks of a job, of like length.

A DDP step waits for the rank with the longest batch, and a batch of variable-length
samples is padded to its longest: with a random order, every step pays for the longest
samples of the epoch's tail. tf.data service's coordinated reads (``num_consumers``) give
every consumer of a round a batch from one length bucket; here the same is a plan, drawn
from the lengths on every rank alike (no communication): the epoch's order is shuffled
with the seed and epoch (as DistributedSampler's), cut into windows of ``window_steps``
steps, each window sorted by length and cut into steps of ``num_replicas * batch_size``
consecutive samples (so a step's batches are alike, and a batch's samples too); the steps
are shuffled again and rank r takes batch r of each step. Every sample once per epoch;
the tail is padded by wrapping around to whole steps, as DistributedSampler pads (or cut,
``drop_last``). The same seed gives the same batches on any number of workers; torch's
DataLoader given this batch sampler yields them too.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np


def plan(lengths: np.ndarray, batch_size: int, num_replicas: int, seed: int, drop_last: bool = False,
         window_steps: int = 64) -> np.ndarray:
    """The epoch's steps: an array (steps, num_replicas, batch_size) of dataset indices."""
    n = len(lengths)
    per_step = batch_size * num_replicas
    rng = np.random.Generator(np.random.PCG64(seed))
    order = rng.permutation(n)
    if drop_last:
        order = order[:n - n % per_step]
    elif n % per_step:
        pad = per_step - n % per_step
        order = np.concatenate([order, np.resize(order, pad)])  # wrapping around, as DistributedSampler pads
    window = per_step * max(1, window_steps)
    for start in range(0, len(order), window):
        part = order[start:start + window]
        order[start:start + window] = part[np.argsort(lengths[part], kind="stable")]
    steps = order.reshape(-1, per_step)
    steps = steps[rng.permutation(len(steps))]
    return steps.reshape(len(steps), num_replicas, batch_size)


class BucketBatchSampler:
    """A batch sampler of rank ``rank`` of ``num_replicas`` whose every step's batches, across
    the ranks, hold samples of like ``lengths`` (see the module). Give it as ``batch_sampler``
    (to a RemoteDataLoader, or ``RemoteDataLoader(coordinated=True, lengths=...)``, or to
    torch's DataLoader, which then yields the same batches); call ``set_epoch`` each epoch,
    as with DistributedSampler. Every rank must be given the same lengths and seed."""

    def __init__(self, lengths: Sequence[int], batch_size: int, *, num_replicas: int = 1, rank: int = 0,
                 seed: int = 0, drop_last: bool = False, window_steps: int = 64) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size should be a positive integer, got {batch_size!r}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"invalid rank {rank} of num_replicas {num_replicas}")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed, self.drop_last, self.window_steps, self.epoch = seed, drop_last, window_steps, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        per_step = self.batch_size * self.num_replicas
        whole, part = divmod(len(self.lengths), per_step)
        return whole if self.drop_last or not part else whole + 1

    def __iter__(self) -> Iterator[list[int]]:
        steps = plan(self.lengths, self.batch_size, self.num_replicas, self.seed + self.epoch, self.drop_last,
                     self.window_steps)
        for step in steps:
            yield step[self.rank].tolist()
