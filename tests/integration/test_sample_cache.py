"""cache="memory" / "disk": a dataset's samples are made once on a worker
and read back in later epochs and by other jobs of the same dataset; the
batches are torch's DataLoader's (the oracle); a dataset that draws at random
is refused at its first sample, naming the index, and for every later job."""
import re

import pytest
from torch.utils.data import DataLoader

import dpex
from dpex.cmd.status import render
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import call, channel
from dpex.testing import datasets, oracle_context, test_cluster
from dpex.testing.cluster import wait_until

N = 48


def calls(path):
    try:
        with open(path) as f:
            return [int(line) for line in f]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def cluster():
    with test_cluster(num_workers=1, processes=2) as c:
        yield c


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_later_epochs_and_other_jobs_read_the_samples_back(cluster, tmp_path, kind):
    path = str(tmp_path / "calls")
    spec = dpex.DatasetSpec("dpex.testing.datasets:Recorded", N, path)
    torch_loader = DataLoader(datasets.Recorded(N, str(tmp_path / "torch")), batch_size=4, shuffle=True,
                              generator=__import__("torch").Generator().manual_seed(3), num_workers=2,
                              multiprocessing_context=oracle_context())
    expected = [[b["i"].tolist() for b in torch_loader] for _ in range(3)]
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=4, shuffle=True, seed=3, cache=kind,
                               timeout=60) as dl:
        got = [[b["i"].tolist() for b in dl]]
        first = len(calls(path))
        got += [[b["i"].tolist() for b in dl] for _ in range(2)]
    assert got == expected and sorted(calls(path)[:first]) == list(range(N))  # epoch 1: each sample made once
    # Later epochs read them back: only the self-check's first hits (2 per batch process) are made again.
    assert len(calls(path)) - first <= 2 * 2
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=6, cache=kind, timeout=60) as other:
        assert [b["i"].tolist() for b in other] == [list(range(k, k + 6)) for k in range(0, N, 6)]
    assert len(calls(path)) - first <= 2 * 2 + 2 * 2  # another job of the same dataset: hits too
    # `dpex status`: the bytes the worker keeps, once a heartbeat said so.
    status = wait_until(lambda: (lambda st: st if st.workers[0].load.sample_cache_bytes else None)(
        call(dgrpc.DispatcherStub(channel(cluster.address)).GetStatus, dpb.GetStatusRequest(),
             target="dispatcher", timeout_s=10)), 30, "the worker's cache bytes")
    assert "CACHED" in render(status) and " MB " in render(status).split("\n")[4]


def epochs_caught(loader, n):
    """``n`` epochs of a loop that catches the worker's errors and goes on, as the docs allow: the
    samples each epoch yielded, and the errors."""
    out = []
    for _ in range(n):
        got, errors, it = [], [], iter(loader)
        while True:
            try:
                got += [x.tolist() for x in next(it)["x"]]
            except StopIteration:
                break
            except dpex.DpexConfigError as e:
                errors.append(str(e))
        out.append((got, errors))
    return out


@pytest.mark.parametrize("kind", ["memory", "disk"])
@pytest.mark.parametrize("dataset", ["Augmented", "Noisy", "OwnGenerator"])
def test_a_dataset_that_draws_at_random_is_never_served_from_the_cache(cluster, kind, dataset):
    """Issue 55: stale random augmentations were served in silence after the first checked hits. Now
    no epoch yields a sample of an earlier one, every batch fails naming its index, and another job
    of the same dataset on that worker is refused at once."""
    spec = dpex.DatasetSpec(f"dpex.testing.datasets:{dataset}", N)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=4, cache=kind, timeout=60) as dl:
        runs = epochs_caught(dl, 3)
    seen = set()
    for got, errors in runs:
        assert not seen & {tuple(x) for x in got}, "a sample of an earlier epoch came back"
        seen |= {tuple(x) for x in got}
        assert len(errors) == N // 4 and all(re.search(r"dataset\[\d+\] cannot be cached", e) for e in errors)
    assert "drew at random" in runs[0][1][0] or "found drawing" in runs[0][1][0]
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=6, shuffle=True, cache=kind, timeout=60) as other:
        got, errors = epochs_caught(other, 1)[0]
    assert got == [] and len(errors) == N // 6 and all("found drawing at random" in e for e in errors)


def test_a_dataset_that_changes_without_the_global_generators_is_caught_by_the_checked_hits(cluster):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Changing", N)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=4, cache="memory", timeout=60) as dl:
        list(dl)  # epoch 1 fills the cache
        with pytest.raises(dpex.DpexConfigError, match=r"dataset\[\d+\] is not what it was when it was cached"):
            list(dl)


def test_a_bad_cache_argument_is_refused_before_anything_starts():
    with pytest.raises(dpex.DpexConfigError, match="cache must be 'memory', 'disk' or None"):
        dpex.RemoteDataLoader("127.0.0.1:1", dpex.DatasetSpec("dpex.testing.datasets:Squares", 4), cache="ram")
