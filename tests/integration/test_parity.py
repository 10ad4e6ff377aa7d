"""RemoteDataLoader yields, element for element, what torch's DataLoader yields."""
import itertools

import pytest
import torch
from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, Sampler,
                              SequentialSampler, SubsetRandomSampler)

import dpex
from dpex.testing.datasets import Mixed, Squares

N = 53
SPEC = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=N)


def assert_same_batches(ours, theirs):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a["y"].tolist() == b["y"].tolist()
        assert torch.equal(a["x"], b["x"])


def epochs(loader, n=2):
    out = []
    for e in range(n):
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(e)
        out.append(list(loader))
    return out


@pytest.mark.parametrize("kwargs", [
    dict(batch_size=8),
    dict(batch_size=8, drop_last=True),
    dict(batch_size=5, shuffle=True),
    dict(batch_size=7, shuffle=True, drop_last=True),
])
def test_same_batches_with_the_global_rng(cluster, kwargs):
    torch.manual_seed(1234)
    theirs = [list(DataLoader(Squares(N), **kwargs)) for _ in range(2)]
    torch.manual_seed(1234)
    with dpex.RemoteDataLoader(cluster.address, SPEC, timeout=60, **kwargs) as loader:
        assert len(loader) == len(theirs[0])
        ours = [list(loader) for _ in range(2)]
    for a, b in zip(ours, theirs):
        assert_same_batches(a, b)
    if kwargs.get("shuffle"):
        assert [b["y"].tolist() for b in ours[0]] != [b["y"].tolist() for b in ours[1]]


def test_seed_means_a_seeded_generator(cluster):
    theirs = epochs(DataLoader(Squares(N), batch_size=6, shuffle=True,
                               generator=torch.Generator().manual_seed(7)))
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=6, shuffle=True, seed=7, timeout=60) as dl:
        ours = epochs(dl)
    for a, b in zip(ours, theirs):
        assert_same_batches(a, b)


def test_custom_sampler(cluster):
    idx = list(range(0, N, 3))
    theirs = list(DataLoader(Squares(N), batch_size=4,
                             sampler=SubsetRandomSampler(idx, generator=torch.Generator().manual_seed(3))))
    sampler = SubsetRandomSampler(idx, generator=torch.Generator().manual_seed(3))
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=4, sampler=sampler, timeout=60) as dl:
        assert_same_batches(list(dl), theirs)


class Uneven(Sampler):
    """Batches of growing size: 1, 2, 3, ..."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        it = iter(range(self.n))
        for size in itertools.count(1):
            batch = list(itertools.islice(it, size))
            if not batch:
                return
            yield batch

    def __len__(self):
        return sum(1 for _ in self)


@pytest.mark.parametrize("make", [lambda: BatchSampler(SequentialSampler(range(N)), 9, False),
                                  lambda: Uneven(N)], ids=["BatchSampler", "custom"])
def test_batch_sampler(cluster, make):
    theirs = list(DataLoader(Squares(N), batch_sampler=make()))
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_sampler=make(), timeout=60) as dl:
        assert_same_batches(list(dl), theirs)


@pytest.mark.parametrize("shuffle,drop_last", [(True, False), (False, True)])
def test_two_consumers_match_distributed_sampler(cluster, shuffle, drop_last):
    name = f"ddp-{shuffle}-{drop_last}"
    loaders = [dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=4, shuffle=shuffle, seed=11,
                                     drop_last=drop_last, num_consumers=2, consumer_index=r,
                                     job_name=name, timeout=60) for r in range(2)]
    try:
        assert loaders[0].job_id == loaders[1].job_id  # one job, two consumers
        seen = set()
        for epoch in range(2):
            per_rank = []
            for rank, loader in enumerate(loaders):
                loader.set_epoch(epoch)
                ref_sampler = DistributedSampler(Squares(N), num_replicas=2, rank=rank,
                                                 shuffle=shuffle, seed=11)
                ref_sampler.set_epoch(epoch)
                theirs = list(DataLoader(Squares(N), batch_size=4, sampler=ref_sampler, drop_last=drop_last))
                ours = list(loader)
                assert_same_batches(ours, theirs)
                per_rank.append(ours)
                seen |= {y for b in ours for y in b["y"].tolist()}
            assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0])
        assert len(seen) >= N - 8  # the ranks together cover the dataset
    finally:
        for loader in loaders:
            loader.close()


def test_unordered_yields_the_same_batches(cluster):
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=3, ordered=False, timeout=60) as dl:
        ours = sorted(tuple(b["y"].tolist()) for b in dl)
    assert ours == sorted(tuple(b["y"].tolist()) for b in DataLoader(Squares(N), batch_size=3))


def test_several_loaders_in_one_process(cluster):
    a = dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=5, timeout=60)
    b = dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=20),
                              batch_size=2, shuffle=True, seed=1, timeout=60)
    try:
        got = list(zip(a, b))  # interleaved iteration
        assert len(got) == min(len(a), len(b)) == 10
        assert [x["y"].tolist() for x, _ in got] == [list(range(i, i + 5)) for i in range(0, 50, 5)]
        assert sorted(y for _, z in got for y in z["y"].tolist()) == list(range(20))
    finally:
        a.close()
        b.close()


def test_collate_fn_is_shipped_and_runs_on_the_worker(cluster):
    collate = lambda samples: {"sum": torch.stack([s["x"] for s in samples]).sum(0), "n": len(samples)}
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=10, collate_fn=collate, timeout=60) as dl:
        ours = list(dl)
    theirs = list(DataLoader(Squares(N), batch_size=10, collate_fn=collate))
    assert [b["n"] for b in ours] == [b["n"] for b in theirs]
    assert all(torch.equal(a["sum"], b["sum"]) for a, b in zip(ours, theirs))


def test_mixed_types_and_a_dataset_instance(cluster):
    theirs = list(DataLoader(Mixed(), batch_size=4))
    with dpex.RemoteDataLoader(cluster.address, Mixed(), batch_size=4, timeout=60) as dl:
        ours = list(dl)
    for a, b in zip(ours, theirs):
        assert torch.equal(a[0], b[0]) and a[1] == b[1]
        assert torch.equal(a[2][0], b[2][0]) and a[2][0].dtype == torch.bfloat16
        assert torch.equal(a[2][1], b[2][1])


def test_empty_dataset_gives_no_batches(cluster):
    with dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=0),
                               batch_size=4, timeout=30) as dl:
        assert len(dl) == 0 and list(dl) == []


def test_breaking_out_of_an_epoch_and_starting_the_next(cluster):
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=2, timeout=60) as dl:
        first = next(iter(dl))
        assert first["y"].tolist() == [0, 1]
        assert len(list(dl)) == len(dl)


def test_a_callable_target_is_shipped_and_called_on_the_worker(cluster):
    spec = dpex.DatasetSpec(lambda n, dim: Squares(n, dim), 9, dim=2)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=3, timeout=60) as dl:
        assert_same_batches(list(dl), list(DataLoader(Squares(9, 2), batch_size=3)))
