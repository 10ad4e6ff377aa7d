"""Coordinated reads' plan through Dpex (issue 59): dpex.BucketBatchSampler, rank by rank, gives the
batches torch's DataLoader gives with it, every sample once per epoch across the ranks, each step's
batches of like length; with random draws, bitwise the same on one worker as on three."""
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dpex
from dpex.testing import test_cluster
from dpex.testing.datasets import Augmented, heavy_tailed_lengths

N, B, WORLD = 120, 4, 3


def epochs(address, rank, lengths):
    sampler = dpex.BucketBatchSampler(lengths, B, num_replicas=WORLD, rank=rank, seed=5)
    generator = torch.Generator().manual_seed(11)  # the epochs' base seeds, as each rank of a seeded run draws them
    with dpex.RemoteDataLoader(address, Augmented(N), batch_sampler=sampler, timeout=60, generator=generator) as dl:
        got = []
        for epoch in range(2):
            dl.set_epoch(epoch)
            got.append([(b["i"].tolist(), b["x"].numpy().tobytes()) for b in dl])
        return got


def test_ranks_get_torchs_batches_of_like_length_and_the_same_draws_on_any_number_of_workers():
    lengths = heavy_tailed_lengths(N)
    runs = {}
    for workers in (1, 3):
        with test_cluster(num_workers=workers) as c:
            got = {}
            threads = [threading.Thread(target=lambda r=r: got.__setitem__(r, epochs(c.address, r, lengths)))
                       for r in range(WORLD)]
            [t.start() for t in threads]
            [t.join() for t in threads]
            runs[workers] = got
    assert runs[1] == runs[3]  # indices and every random draw, bitwise
    for epoch in range(2):
        ranks = [[i for i, _ in runs[1][r][epoch]] for r in range(WORLD)]
        for r in range(WORLD):  # torch's DataLoader with the same batch sampler: the same batches
            sampler = dpex.BucketBatchSampler(lengths, B, num_replicas=WORLD, rank=r, seed=5)
            sampler.set_epoch(epoch)
            assert [b["i"].tolist() for b in DataLoader(Augmented(N), batch_sampler=sampler)] == ranks[r]
        assert sorted(i for r in ranks for b in r for i in b) == list(range(N))  # every sample once
        steps = np.array(ranks)  # (rank, step, sample)
        spread = [np.ptp(np.array(lengths)[steps[:, k]]) for k in range(steps.shape[1])]
        assert np.median(spread) < 0.25 * np.ptp(lengths)  # a step's batches from one length bucket


def test_lengths_plan_coordinated_reads_for_each_rank_of_the_job():
    """RemoteDataLoader(lengths=...) is BucketBatchSampler for its consumer of the job (seed: the loader's);
    lengths as a function of a sample are read here, on the trainer."""
    lengths = heavy_tailed_lengths(N)
    with test_cluster(num_workers=2) as c:
        got = {}

        def rank(r, given):
            with dpex.RemoteDataLoader(c.address, Augmented(N), batch_size=B, lengths=given, seed=5, num_consumers=2,
                                       consumer_index=r, job_name=f"coordinated {callable(given)}", timeout=60) as dl:
                got[r, callable(given)] = [b["i"].tolist() for b in dl]
        threads = [threading.Thread(target=rank, args=(r, given)) for r in range(2)
                   for given in (lengths, lambda sample: lengths[sample["i"]])]
        [t.start() for t in threads]
        [t.join() for t in threads]
    for r in range(2):
        want = list(dpex.BucketBatchSampler(lengths, B, num_replicas=2, rank=r, seed=5))
        assert got[r, False] == got[r, True] == want
    with pytest.raises(dpex.DpexConfigError, match="plans the batches itself"):
        dpex.RemoteDataLoader(c.address, Augmented(N), batch_size=B, lengths=lengths, sampler=range(N))
