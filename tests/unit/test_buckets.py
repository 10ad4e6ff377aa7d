"""dpex.plan.buckets: coordinated reads' plan. Each step's batches across the ranks come from one
window's sorted run (alike lengths), every sample once (the tail wrapped around as DistributedSampler
pads), the same on every rank and for torch's DataLoader."""
import numpy as np
import torch

from dpex.plan.buckets import BucketBatchSampler, plan


def lengths(n, seed=0):
    return np.random.Generator(np.random.PCG64(seed)).lognormal(4, 1, n).astype(np.int64) + 1


def test_every_sample_once_each_step_one_length_bucket():
    lens = lengths(1000)
    steps = plan(lens, 8, 4, seed=3)
    assert steps.shape == (32, 4, 8)  # 1000 -> 1024: 24 wrapped around
    flat = steps.reshape(-1)
    assert set(flat.tolist()) == set(range(1000)) and len(flat) == 1024
    random_order = np.random.Generator(np.random.PCG64(3)).permutation(1000)[:960].reshape(-1, 4, 8)
    padded = lambda s: lens[s].max(axis=-1).max(axis=-1).sum()  # noqa: E731 - a DDP step waits for its longest
    assert padded(steps[:30]) < 0.5 * padded(random_order[:30])
    assert plan(lens, 8, 4, seed=3, drop_last=True).shape == (31, 4, 8)


def test_ranks_plan_alike_and_torch_yields_the_same_batches():
    lens = lengths(300)
    ranks = [BucketBatchSampler(lens, 5, num_replicas=3, rank=r, seed=7) for r in range(3)]
    for s in ranks:
        s.set_epoch(2)
    got = [list(s) for s in ranks]
    assert [len(g) for g in got] == [len(s) for s in ranks] == [20, 20, 20]
    assert sorted(i for g in got for b in g for i in b) == list(range(300))
    loader = torch.utils.data.DataLoader(list(range(300)), batch_sampler=ranks[1])
    assert [b.tolist() for b in loader] == got[1]
    again = BucketBatchSampler(lens, 5, num_replicas=3, rank=1, seed=7)
    assert list(again) != got[1]  # epoch 0 is another order
    again.set_epoch(2)
    assert list(again) == got[1]
