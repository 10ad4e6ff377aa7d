"""DpexDataLoader: the one-line change from torch's DataLoader."""
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data._utils.worker import _generate_state

import dpex
from dpex import DpexDataLoader
from dpex.testing.datasets import Big, Faulty, Slow, Squares, WorkerProbe, record_worker_init


def ys(loader):
    return [b["y"].tolist() for b in loader]


def test_import_paths():
    from dpex.dataloader import DpexDataLoader as A
    from Dpex import dataloader
    assert A is DpexDataLoader is dataloader.DpexDataLoader


@pytest.mark.parametrize("num_workers", [0, 2])
def test_without_distribute_mode_it_is_torch(num_workers):
    loader = DpexDataLoader(Squares(20), batch_size=3, shuffle=True, num_workers=num_workers,
                            generator=torch.Generator().manual_seed(1))
    assert type(loader) is DataLoader
    assert ys(loader) == ys(DataLoader(Squares(20), batch_size=3, shuffle=True, num_workers=num_workers,
                                       generator=torch.Generator().manual_seed(1)))


def test_original_signature_positionally(cluster):
    # DpexDataLoader(dataset, distribute_mode, head_address, batch_size, shuffle, sampler,
    #                batch_sampler, num_workers, collate_fn, pin_memory, drop_last, timeout)
    with DpexDataLoader(Squares(20), True, cluster.address, 6, False, None, None, 1, None, False, True, 30) as dl:
        assert isinstance(dl, DpexDataLoader) and dl.batch_size == 6 and dl.drop_last
        assert ys(dl) == [list(range(i, i + 6)) for i in range(0, 18, 6)]


def test_same_batches_as_torch_with_generator_and_global_rng(cluster):
    kw = dict(batch_size=4, shuffle=True)
    theirs = ys(DataLoader(Squares(30), generator=torch.Generator().manual_seed(3), **kw))
    with DpexDataLoader(Squares(30), distribute_mode=True, head_address=cluster.address, num_workers=2,
                        generator=torch.Generator().manual_seed(3), **kw) as dl:
        assert len(dl) == 8 and ys(dl) == theirs
    torch.manual_seed(9)
    theirs = [ys(DataLoader(Squares(30), **kw)) for _ in range(2)]
    torch.manual_seed(9)
    with DpexDataLoader(Squares(30), distribute_mode=True, head_address=cluster.address, **kw) as dl:
        assert [ys(dl) for _ in range(2)] == theirs


def test_head_address_auto_reads_the_environment(cluster, monkeypatch):
    monkeypatch.setenv("DPEX_DISPATCHER", cluster.address)
    with DpexDataLoader(Squares(8), distribute_mode=True, batch_size=4) as dl:
        assert dl.dispatcher_address == cluster.address and ys(dl) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_head_address_forms_and_a_worker_given_for_the_dispatcher(cluster, monkeypatch):
    monkeypatch.delenv("DPEX_DISPATCHER", raising=False)
    for head in ("dpex://" + cluster.address, cluster.address):
        with DpexDataLoader(Squares(8), distribute_mode=True, head_address=head, batch_size=4) as dl:
            assert dl.dispatcher_address == cluster.address and ys(dl) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(dpex.DpexConfigError, match="is a Dpex worker, not the dispatcher"):
        DpexDataLoader(Squares(8), distribute_mode=True, head_address=cluster.workers[0].address)


def test_distributed_sampler_shards(cluster):
    shards = []
    for rank in range(2):
        sampler = DistributedSampler(Squares(21), num_replicas=2, rank=rank, shuffle=True, seed=4)
        with DpexDataLoader(Squares(21), distribute_mode=True, head_address=cluster.address, batch_size=5,
                            sampler=sampler) as dl:
            dl.sampler.set_epoch(1)
            ref = DistributedSampler(Squares(21), num_replicas=2, rank=rank, shuffle=True, seed=4)
            ref.set_epoch(1)
            got = ys(dl)
            assert got == ys(DataLoader(Squares(21), batch_size=5, sampler=ref))
            shards.append([y for b in got for y in b])
    assert len(shards[0]) == len(shards[1]) == 11 and set(shards[0]) | set(shards[1]) == set(range(21))


def expected_base_seed(generator_seed):
    return torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(generator_seed)).item()


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_info_seeds_and_worker_init_fn_as_in_torch(persistent):
    # One worker daemon with two processes: worker ids 0 and 1, as num_workers=2 in torch.
    with dpex.testing.test_cluster(num_workers=1, processes=2) as c:
        with DpexDataLoader(WorkerProbe(64), distribute_mode=True, head_address=c.address, batch_size=2,
                            num_workers=2, worker_init_fn=record_worker_init, persistent_workers=persistent,
                            generator=torch.Generator().manual_seed(5)) as dl:
            samples = [dict(zip(b, vals)) for b in dl for vals in zip(*[b[k] for k in b])]
            second = [dict(zip(b, vals)) for b in dl for vals in zip(*[b[k] for k in b])]
    base = expected_base_seed(5)
    assert {s["id"].item() for s in samples} <= {0, 1} and {s["num_workers"].item() for s in samples} == {2}
    for s in samples:
        wid = s["id"].item()
        assert s["seed"].item() == base + wid == s["torch_seed"].item()
        rs = np.random.RandomState()
        rs.seed(_generate_state(base, wid))
        assert s["np_state"].tolist() == rs.get_state()[1][:4].tolist()
        assert s["init_calls"].item() == 1
    # worker_init_fn once per epoch a process works in, or once. (A process
    # may have made no batch of the first epoch: the second one may still have
    # been starting while the first made them all.)
    first = {s["pid"].item() for s in samples}
    for s in second:
        assert s["init_calls"].item() == (1 if persistent or s["pid"].item() not in first else 2)
    assert persistent or any(s["init_calls"].item() == 2 for s in second)
    if not persistent:  # a new epoch, a new base seed
        assert {s["seed"].item() for s in second}.isdisjoint({s["seed"].item() for s in samples})


def test_timeout_raises_torchs_error(cluster):
    with DpexDataLoader(Slow(4, delay_s=3), distribute_mode=True, head_address=cluster.address,
                        batch_size=1, timeout=1) as dl:
        with pytest.raises(RuntimeError, match=r"^DataLoader timed out after 1 seconds$"):
            list(dl)


def test_pin_memory_without_accelerator_warns_like_torch(cluster):
    with pytest.warns(UserWarning, match="no accelerator is found"):
        dl = DpexDataLoader(Squares(4), distribute_mode=True, head_address=cluster.address, batch_size=2,
                            pin_memory=True)
    with dl:
        assert ys(dl) == [[0, 1], [2, 3]]


def test_bug_dataset_raises_a_clear_error(cluster):
    with DpexDataLoader(Faulty(16, bad=5), distribute_mode=True, head_address=cluster.address,
                        batch_size=4, num_workers=2) as dl:
        with pytest.raises(dpex.DpexWorkerError, match=r"ZeroDivisionError: division by zero \(raised in dataset\[5\]"):
            list(dl)


def test_large_dataset_instance_warns_and_points_to_datasetspec(cluster):
    with pytest.warns(UserWarning, match=r"pickles to 6\.\d MB and goes to every worker by value; if it reads "
                      r"files, dpex.DatasetSpec") as caught:
        DpexDataLoader(Big(), distribute_mode=True, head_address=cluster.address, batch_size=4).close()
    assert caught[0].filename == __file__  # the user's line, not Dpex's (issue 55)


@pytest.mark.parametrize("kwargs", [dict(batch_size=4, shuffle=True), dict(batch_size=None)])
def test_a_dataset_spec_as_torch_plans_the_instance(cluster, kwargs):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=10)
    with DpexDataLoader(spec, distribute_mode=True, head_address=cluster.address,
                        generator=torch.Generator().manual_seed(2), **kwargs) as dl:
        theirs = DataLoader(Squares(10), generator=torch.Generator().manual_seed(2), **kwargs)
        assert dl.dataset is spec and len(dl) == len(theirs)
        assert [torch.as_tensor(b["y"]).tolist() for b in dl] == [torch.as_tensor(b["y"]).tolist() for b in theirs]
