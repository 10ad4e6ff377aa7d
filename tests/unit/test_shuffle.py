"""ShuffleSampler: a bijection at every size, the same batches described as
iterated (in torch's DataLoader), DistributedSampler's sharing, any batch of
10^9 samples without the rest, and a worker with another order refusing."""
import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud

import dpex
from dpex.client.sampling import Indices
from dpex.errors import DpexConfigError
from dpex.plan import samplers, shuffle
from dpex.proto import dispatcher_pb2 as dpb


@pytest.mark.parametrize("n", [*range(0, 70), 127, 128, 129, 1000, 4095, 4097, 100_003])
def test_every_length_is_a_bijection(n):
    for seed in (0, 1, 2**64 - 1):
        order = shuffle.Permutation(n, seed)(np.arange(n))
        assert sorted(order.tolist()) == list(range(n))


def test_the_seed_picks_the_order_and_the_order_is_shuffled():
    n = 10_000
    orders = [shuffle.Permutation(n, seed)(np.arange(n)) for seed in range(20)]
    assert all(np.array_equal(o, shuffle.Permutation(n, seed)(np.arange(n))) for seed, o in enumerate(orders))
    assert len({o.tobytes() for o in orders}) == 20
    for order in orders:  # no trace of the identity, and no fixed stride
        assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.05
        assert np.mean(order == np.arange(n)) < 0.01
        assert len(np.unique(np.diff(order))) > n // 2
    # where a given index lands over many seeds: spread over the whole range
    firsts = [int(shuffle.Permutation(100, seed)(np.arange(1))[0]) for seed in range(5000)]
    counts = np.bincount(firsts, minlength=100)
    assert counts.min() > 20 and counts.max() < 85  # mean 50


def _loader(sampler, batch_size, drop_last=False):
    return tud.DataLoader(Indices(sampler.length), batch_size=batch_size, sampler=sampler,
                          drop_last=drop_last, collate_fn=list)


CASES = {
    "seeded": lambda: (dpex.ShuffleSampler(103, seed=7), 10, False),
    "drop-last": lambda: (dpex.ShuffleSampler(103, seed=7), 10, True),
    "global-rng": lambda: (dpex.ShuffleSampler(Indices(50)), 8, False),
    "ranks": lambda: (dpex.ShuffleSampler(103, seed=3, num_replicas=4, rank=1), 4, False),
    "ranks-drop-last": lambda: (dpex.ShuffleSampler(103, seed=3, num_replicas=4, rank=3, drop_last=True), 4, False),
    "more-ranks-than-samples": lambda: (dpex.ShuffleSampler(3, seed=1, num_replicas=8, rank=7), 2, False),
    "empty": lambda: (dpex.ShuffleSampler(0, seed=1), 4, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_description_expands_to_the_iterated_batches_and_rng_state(case):
    runs = []
    for compact in (False, True):
        torch.manual_seed(11)
        sampler, size, drop_last = CASES[case]()
        loader, out = _loader(sampler, size, drop_last), []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            it = iter(loader)
            if compact:
                spec = samplers.describe(loader)
                assert spec.kind == spec.SHUFFLE and len(spec.SerializeToString()) < 60
                assert samplers.num_batches(spec) == len(loader)
                batches = samplers.batches(spec, 0, samplers.num_batches(spec))
            else:
                batches = [list(b) for b in it]
            out.append((batches, torch.get_rng_state()))
        runs.append(out)
    assert all(b == c and torch.equal(r, s) for (b, r), (c, s) in zip(*runs))
    assert runs[0][0][0] != runs[0][1][0] or case in ("empty", "more-ranks-than-samples")  # epochs differ


def test_the_ranks_share_the_epoch_as_distributed_sampler_does():
    n, world = 103, 4
    shares = [list(dpex.ShuffleSampler(n, seed=5, num_replicas=world, rank=r)) for r in range(world)]
    assert all(len(s) == 26 for s in shares)
    flat = [i for j in range(26) for i in (s[j] for s in shares)]  # rank r's j-th is position r + j * world
    assert sorted(set(flat)) == list(range(n)) and len(flat) == 104  # one padded, from the start
    assert flat[-1] == flat[0]
    cut = [list(dpex.ShuffleSampler(n, seed=5, num_replicas=world, rank=r, drop_last=True)) for r in range(world)]
    assert all(len(s) == 25 for s in cut) and len({i for s in cut for i in s}) == 100


def test_any_batch_of_a_billion_samples_without_the_rest():
    n, size = 10**9, 1024
    sampler = dpex.ShuffleSampler(n, seed=1)
    loader = _loader(sampler, size)
    iter(loader)
    spec = samplers.describe(loader)
    assert len(spec.SerializeToString()) < 60 and samplers.num_batches(spec) == 976563
    picks = [0, 976562, *random.Random(3).sample(range(976562), 20)]
    got = {k: samplers.batches(spec, k, 1)[0] for k in picks}
    assert len(got[976562]) == n - 976562 * size
    every = [i for k in picks for i in got[k]]
    assert len(set(every)) == len(every) and 0 <= min(every) and max(every) < n
    head = list(next(iter(loader)))  # torch's DataLoader iterating the sampler: the same first batch
    assert head == got[0]


def test_bad_arguments_and_another_order_are_refused():
    with pytest.raises(ValueError, match="needs a seed"):
        dpex.ShuffleSampler(10, num_replicas=2, rank=0)
    with pytest.raises(ValueError, match="invalid rank"):
        dpex.ShuffleSampler(10, seed=0, num_replicas=2, rank=2)
    loader = _loader(dpex.ShuffleSampler(10, seed=0), 2)
    iter(loader)
    spec = samplers.describe(loader)
    spec.algorithm = "feistel4-old"
    with pytest.raises(DpexConfigError, match=rf"'feistel4-old'.*'{shuffle.ALGORITHM}'"):
        samplers.batches(spec, 0, 1)
    for bad in (dpb.SamplerSpec(kind=7, batch_size=1), dpb.SamplerSpec(kind=dpb.SamplerSpec.SHUFFLE),
                dpb.SamplerSpec(kind=dpb.SamplerSpec.SHUFFLE, batch_size=2, num_replicas=2, rank=2)):
        with pytest.raises(DpexConfigError):
            samplers.validate(bad)
