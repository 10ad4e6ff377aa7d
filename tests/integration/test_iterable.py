"""IterableDataset on Dpex workers: each stream is torch's worker k of N,
batches come round-robin as from torch's workers, with no duplicates."""
import itertools
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import dpex
from dpex import DpexDataLoader
from dpex.testing.datasets import BrokenStream, Counting, Endless


def items(loader):
    return [b["i"].tolist() for b in loader]


@pytest.mark.parametrize("num_workers,batch_size,drop_last", [(1, 8, False), (2, 4, False), (3, 5, True)])
def test_same_batches_in_the_same_order_as_torch(cluster, num_workers, batch_size, drop_last):
    kw = dict(batch_size=batch_size, num_workers=num_workers, drop_last=drop_last)
    theirs = items(DataLoader(Counting(50), **kw))
    with DpexDataLoader(Counting(50), distribute_mode=True, head_address=cluster.address, **kw) as dl:
        assert len(dl) == len(DataLoader(Counting(50), **kw))
        for _ in range(2):
            assert items(dl) == theirs
        stages = dl.stats().stages  # each stream times its batches too (issue 56)
        assert {"dataset", "dataset_cpu", "dataset_cpu_wait", "collate", "collate_cpu", "collate_cpu_wait", "dpex",
                "decode"} == set(stages) and stages["dataset"] > 0
    flat = [i for b in theirs for i in b]
    assert len(flat) == len(set(flat))  # no duplicates


def test_each_stream_is_a_torch_worker(cluster):
    g = torch.Generator().manual_seed(2)
    base = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(2)).item()
    with DpexDataLoader(Counting(30), distribute_mode=True, head_address=cluster.address, batch_size=3,
                        num_workers=3, generator=g) as dl:
        for b in dl:
            worker = b["worker"].tolist()
            assert worker == [i % 3 for i in b["i"].tolist()] and len(set(worker)) == 1
            assert b["seed"].tolist() == [base + worker[0]] * len(worker)


def test_a_dataset_spec_and_unordered_delivery(cluster):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Counting", n=40)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=4, num_workers=2, ordered=False,
                               timeout=60) as dl:
        got = sorted(i for b in dl for i in b["i"].tolist())
    assert got == list(range(40))


def test_a_dataset_without_len_and_an_early_break(cluster):
    with DpexDataLoader(Endless(), distribute_mode=True, head_address=cluster.address, batch_size=2,
                        num_workers=2) as dl:
        with pytest.raises(TypeError):
            len(dl)
        first = [b.tolist() for b in itertools.islice(dl, 5)]
        assert first == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10]]
        assert [b.tolist() for b in itertools.islice(dl, 2)] == [[0, 2], [1, 3]]  # a new epoch


def test_an_error_while_iterating(cluster):
    with DpexDataLoader(BrokenStream(20), distribute_mode=True, head_address=cluster.address,
                        batch_size=2, num_workers=1) as dl:
        with pytest.raises(dpex.DpexWorkerError, match="ValueError: bad record 7 \\(raised while iterating"):
            items(dl)


@pytest.mark.parametrize("arg", [dict(shuffle=True), dict(sampler=[1, 2])])
def test_torchs_argument_checks(cluster, arg):
    with pytest.raises(ValueError, match="DataLoader with IterableDataset: expected unspecified"):
        DpexDataLoader(Counting(10), distribute_mode=True, head_address=cluster.address, **arg)



def test_a_streams_process_starts_without_the_workers_main_or_grpc_threads(cluster):
    """A stream's process is forked each epoch from the worker's forkserver, itself forked from the worker
    as it started: it imports nothing again (its modules, gRPC's among them, are the worker's as they were
    before its server started), runs no gRPC thread, and does not re-run dpex-worker's main module
    (multiprocessing would, and import its server: a quarter of a second per epoch, issue 55's tester)."""
    class WhatTheStreamHas(torch.utils.data.IterableDataset):  # here: pickled by value, as a script's
        def __iter__(self):
            from dpex.daemon import can_fork
            main = sys.modules.get("__mp_main__")
            yield {"grpc_threads": not can_fork(), "torch": "torch" in sys.modules,
                   "main": str(getattr(main, "__file__", None)), "main_spec": str(getattr(main, "__spec__", None))}

    with DpexDataLoader(WhatTheStreamHas(), distribute_mode=True, head_address=cluster.address,
                        batch_size=None, num_workers=1) as dl:
        assert list(dl) == [{"grpc_threads": False, "torch": True, "main": "None", "main_spec": "None"}]
