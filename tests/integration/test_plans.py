"""Plans on the wire: torch's samplers as descriptions, other samplers in
bounded chunks kept on the dispatcher's disk, and a worker with another torch
release refusing a description."""
import os

import pytest
import torch
import torch.utils.data as tud

import dpex
from dpex.client.sampling import Indices
from dpex.dispatcher.journal import FILE_NAME, read_records
from dpex.plan import samplers
from dpex.proto import dispatcher_pb2 as dpb
from dpex.testing import test_cluster


def plans_in_journal(work_dir):
    updates, _ = read_records(os.path.join(work_dir, FILE_NAME))
    return [u.submit_plan for u in updates if u.WhichOneof("kind") == "submit_plan"]


def test_torchs_samplers_travel_as_descriptions_and_give_torchs_batches(tmp_path):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=1000)
    # (no compaction: the records are read back from the log)
    with test_cluster(num_workers=2, work_dir=str(tmp_path), dispatcher_flags=("--journal-compact-kb", "0")) as c:
        with dpex.RemoteDataLoader(c.address, spec, batch_size=32, shuffle=True, seed=4, timeout=60) as dl:
            reference = tud.DataLoader(Indices(1000), batch_size=32, shuffle=True,
                                       generator=torch.Generator().manual_seed(4))
            for _ in range(2):
                assert [b["y"].tolist() for b in dl] == [b.tolist() for b in reference]
        plans = plans_in_journal(str(tmp_path))
        assert len(plans) == 2 and all(p.HasField("sampler") and not p.batches and not p.plan_file
                                       for p in plans)
        assert all(len(p.SerializeToString()) < 4096 for p in plans)
        assert os.listdir(os.path.join(tmp_path, "plans")) == []


class EveryThird(tud.Sampler):
    """A sampler torch does not have: its indices must be sent."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return -(-self.n // 3)

    def __iter__(self):
        return iter(range(self.n - 1, -1, -3))


def test_ten_million_indices_of_a_foreign_sampler_go_in_chunks_and_survive_a_kill(tmp_path):
    n, size = 3 * 10**7, 10_000  # 10^7 indices planned, 1,000 batches
    spec = dpex.DatasetSpec("dpex.client.sampling:Indices", n)  # item i is i
    sampler = EveryThird(n)
    # 4 MB messages: one message of the plan would be 80 MB.
    with test_cluster(num_workers=2, work_dir=str(tmp_path), split_size_batches=50,
                      dispatcher_flags=("--max-message-mb", "4", "--journal-compact-kb", "0")) as c:
        with dpex.RemoteDataLoader(c.address, spec, batch_size=size, sampler=sampler, timeout=120) as dl:
            count = 0
            for i, batch in enumerate(dl):
                first = n - 1 - i * 3 * size
                assert torch.equal(batch, torch.arange(first, max(-1, first - 3 * size), -3))
                count += 1
                if i == 100:
                    files = os.listdir(os.path.join(tmp_path, "plans"))
                    assert len(files) == 2 and sum(os.path.getsize(os.path.join(tmp_path, "plans", f))
                                                   for f in files) > 8 * 10**7
                    c.restart_dispatcher()  # kill -9; the journal names the plan file
            assert count == 1000
        plan, = plans_in_journal(str(tmp_path))
        assert plan.plan_file and not plan.batches and plan.num_batches == 1000


def test_a_worker_with_another_torch_release_refuses_the_description(monkeypatch):
    real = samplers.torch_version()
    monkeypatch.setattr(samplers, "torch_version", lambda: "2.99.0")  # the trainer's, as if newer
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=100)
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, spec, batch_size=10, shuffle=True, timeout=60) as dl:
            with pytest.raises(dpex.DpexWorkerError, match=r"torch 2\.99\.0.*worker has torch "
                                                           + real.replace(".", r"\.")):
                next(iter(dl))


def test_a_shuffle_sampler_travels_as_a_description_and_gives_torchs_batches_at_any_size(tmp_path):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=1000)
    with test_cluster(num_workers=2, work_dir=str(tmp_path), dispatcher_flags=("--journal-compact-kb", "0")) as c:
        sampler = dpex.ShuffleSampler(1000, seed=4)
        reference = tud.DataLoader(Indices(1000), batch_size=32, sampler=dpex.ShuffleSampler(1000, seed=4))
        with dpex.RemoteDataLoader(c.address, spec, batch_size=32, sampler=sampler, timeout=60) as dl:
            for epoch in range(2):
                dl.set_epoch(epoch)
                reference.sampler.set_epoch(epoch)
                assert [b["y"].tolist() for b in dl] == [b.tolist() for b in reference]
        plans = plans_in_journal(str(tmp_path))
        assert [p.sampler.kind for p in plans] == [dpb.SamplerSpec.SHUFFLE] * 2
        assert all(len(p.SerializeToString()) < 128 for p in plans)  # a few numbers and the 16-byte share key
        # a billion samples: the first batch without drawing the rest, on the worker and in torch alike
        billion = dpex.DatasetSpec("dpex.client.sampling:Indices", 10**9)
        with dpex.RemoteDataLoader(c.address, billion, batch_size=1024, sampler=dpex.ShuffleSampler(10**9, seed=1),
                                   timeout=60) as dl:
            torch_first = next(iter(tud.DataLoader(Indices(10**9), batch_size=1024,
                                                   sampler=dpex.ShuffleSampler(10**9, seed=1))))
            assert torch.equal(next(iter(dl)), torch_first)
