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

An IterableDataset has no lengths ahead: :class:`BucketedIterable` buckets on the fly, in the
stream (a torch worker, or a Dpex worker's stream process), round by round. Each stream
reads a window of ``window_batches * batch_size`` samples, sorts it by length, cuts it into
batches and yields them in an order drawn from (seed, epoch, window) alone: every rank's
stream k yields, at its j-th batch, the same quantile of its own window. With ranks'
shards of one corpus the quantiles are alike, so a step's batches are, with no
communication; every sample once, memory bounded by the window.
"""
from __future__ import annotations

from itertools import islice
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch.utils.data as tud


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
    """A batch sampler whose every step's batches, across the ranks, hold samples of like length.

    See the module's notes. Give it as ``batch_sampler``
    (to a RemoteDataLoader, which ``RemoteDataLoader(lengths=...)`` does for you, or to
    torch's DataLoader, which then yields the same batches); call ``set_epoch`` each epoch,
    as with DistributedSampler. Every rank must be given the same lengths and seed.

    Args:
        lengths: each sample's length.
        batch_size: samples a batch.
        num_replicas: ranks sharing each step.
        rank: this rank.
        seed: the order's seed (with the epoch's).
        drop_last: cut the tail instead of padding it to whole steps by wrapping around.
        window_steps: steps in a window, the span sorted by length.

    Raises:
        ValueError: a batch size below 1, or a rank outside ``num_replicas``.
    """

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
        """Sets the epoch the next ``iter()`` plans.

        Args:
            epoch: the epoch."""
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


def window_order(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, window: int) -> list[np.ndarray]:
    """A window's batches, as positions in it: sorted by length, cut into batches of
    ``batch_size``, the whole ones in an order drawn from (seed, epoch, window), a part last."""
    order = np.argsort(np.asarray(lengths, dtype=np.int64), kind="stable")
    whole = len(order) // batch_size
    batches = [order[i * batch_size:(i + 1) * batch_size]
               for i in np.random.Generator(np.random.PCG64([seed, epoch, window])).permutation(whole)]
    if len(order) % batch_size:
        batches.append(order[whole * batch_size:])  # the stream's last: drop_last drops it, as torch
    return batches


class BucketedIterable(tud.IterableDataset):
    """Coordinated reads for an IterableDataset: every ``batch_size`` consecutive samples of like length.

    See the module's notes. Give it to a
    RemoteDataLoader, or to torch's DataLoader (which then yields the same batches), with the
    same ``batch_size``; ``RemoteDataLoader(lengths=fn)`` wraps an IterableDataset in it.
    ``set_epoch`` varies the order by epoch, as DistributedSampler's. Every rank must be given
    the same seed, batch size and window. Where ``dataset`` has torchdata's ``state_dict``, so
    has this one: a resumed stream reads its window again, its generators as they were at the
    window's start, and goes on from the batch it had reached, bitwise as if not stopped.

    Args:
        dataset: the IterableDataset to bucket.
        length_fn: a sample's length.
        batch_size: samples a batch (the loader's too).
        seed: the order's seed (with the epoch's and the window's).
        window_batches: batches a window holds, the span sorted by length (memory is bounded by it).

    Raises:
        ValueError: a batch size or window below 1.
    """

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> "BucketedIterable":
        if cls is BucketedIterable and callable(getattr(dataset, "state_dict", None)) and callable(
                getattr(dataset, "load_state_dict", None)):
            cls = _StatefulBucketed
        return super().__new__(cls)

    def __init__(self, dataset: Any, length_fn: Callable[[Any], int], batch_size: int, *, seed: int = 0,
                 window_batches: int = 64) -> None:
        if batch_size < 1 or window_batches < 1:
            raise ValueError(f"batch_size and window_batches should be positive integers, got {batch_size!r} "
                             f"and {window_batches!r}")
        self.dataset, self.length_fn, self.batch_size = dataset, length_fn, batch_size
        self.seed, self.window_batches, self.epoch = seed, window_batches, 0
        self._resume: dict | None = None  # a state loaded, for the next iter()
        self._state: dict = {}            # where the window being yielded began, and how much of it went

    def set_epoch(self, epoch: int) -> None:
        """Sets the epoch whose order the next ``iter()`` yields.

        Args:
            epoch: the epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[Any]:
        from dpex import seeding
        resume, self._resume = self._resume, None
        samples = iter(self.dataset)
        w, skip = (resume["window"], resume["yielded"]) if resume else (0, 0)
        while True:
            start = {"dataset": None, "rng": seeding.global_states(), "window": w, "yielded": 0}
            if resume:  # read the window again as it was first read, then draw on from where the stream was
                now = start["rng"]
                start["dataset"], start["rng"] = resume["dataset"], resume["rng"]
                seeding.restore_global_states(resume["rng"])
            else:
                start["dataset"] = self._inner_state()
            window = list(islice(samples, self.window_batches * self.batch_size))
            if resume:
                seeding.restore_global_states(now)
                resume = None
            if not window:
                return
            order = np.concatenate(window_order([self.length_fn(s) for s in window], self.batch_size, self.seed,
                                                self.epoch, w))
            self._state = start
            for n, at in enumerate(order[skip:], skip):
                start["yielded"] = n + 1
                yield window[at]
            w, skip = w + 1, 0

    def _inner_state(self) -> Any:
        return None


class _StatefulBucketed(BucketedIterable):
    """A BucketedIterable of a dataset with torchdata's ``state_dict``."""

    def _inner_state(self) -> Any:
        return self.dataset.state_dict()

    def state_dict(self) -> dict:
        return dict(self._state)

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.dataset.load_state_dict(state["dataset"])
            self._resume = dict(state)
