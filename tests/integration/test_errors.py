"""Errors explain themselves: user-code exceptions, bad specs, bad arguments,
unreachable peers. Never a hang: every loader here has a timeout, so a hang
would fail as DpexTimeoutError instead of the expected error."""
import os
import re
import time

import pytest
from torch.utils.data import SequentialSampler

import dpex
from dpex.dispatcher.claims import HELD_S
from dpex.testing import test_cluster, wait_until
from dpex.testing.datasets import Squares


def spec(name, **kwargs):
    return dpex.DatasetSpec(f"dpex.testing.datasets:{name}", **kwargs)


def test_exception_in_getitem_reaches_the_trainer(cluster):
    with dpex.RemoteDataLoader(cluster.address, spec("Faulty", n=40, bad=13), batch_size=4,
                               timeout=30) as dl:
        got = []
        with pytest.raises(dpex.DpexWorkerError) as info:
            for batch in dl:
                got.append(batch["y"].tolist())
    e = info.value
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # in order, up to the bad batch
    assert e.exc_type == "ZeroDivisionError" and e.remote_message == "division by zero"
    assert e.sample_index == 13 and e.stage == "getitem"
    assert e.worker in cluster.worker_addresses
    assert "__getitem__" in e.remote_traceback and "1 / 0" in e.remote_traceback
    assert "dataset[13]" in str(e) and e.worker in str(e)


def test_exception_in_collate(cluster):
    def collate(samples):
        raise KeyError("no such field")
    with dpex.RemoteDataLoader(cluster.address, spec("Squares", n=8), batch_size=4, collate_fn=collate,
                               timeout=30) as dl:
        with pytest.raises(dpex.DpexWorkerError, match="in collate_fn") as info:
            list(dl)
    assert info.value.exc_type == "KeyError" and info.value.sample_index == -1


def test_unencodable_batch(cluster):
    import threading
    with dpex.RemoteDataLoader(cluster.address, spec("Squares", n=8), batch_size=4,
                               collate_fn=lambda s: {"bad": threading.Lock()}, timeout=30) as dl:
        with pytest.raises(dpex.DpexWorkerError, match="cannot encode a value of type _thread.lock: it does not "
                                                       "pickle") as info:
            list(dl)
    assert info.value.stage == "encode"


@pytest.mark.parametrize("target,message", [
    ("no_such_module:Data", "unknown dataset target 'no_such_module:Data'"),
    ("dpex.testing.datasets:Nope", "has no attribute 'Nope'"),
])
def test_unknown_dataset_target(cluster, target, message):
    with pytest.raises(dpex.DpexWorkerError, match=message) as info:
        dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec(target), batch_size=4, timeout=30)
    assert info.value.stage == "build" and "while building the dataset" in str(info.value)


def test_dataset_that_fails_to_build(cluster):
    with pytest.raises(dpex.DpexWorkerError, match="no data at /data/x") as info:
        dpex.RemoteDataLoader(cluster.address, spec("BrokenInit", path="/data/x"), timeout=30)
    assert info.value.exc_type == "FileNotFoundError"


def test_unreachable_dispatcher():
    with pytest.raises(dpex.DpexConnectionError, match="cannot reach dispatcher 127.0.0.1:1"):
        dpex.RemoteDataLoader("127.0.0.1:1", spec("Squares"), connect_timeout=0.5)


@pytest.mark.parametrize("kwargs,message", [
    (dict(address="no-port"), "expected HOST:PORT"),
    (dict(num_consumers=2, consumer_index=2), "consumer_index must be in 0..1"),
    (dict(timeout=-1), "timeout must be > 0"),
    (dict(dataset=None), "needs a dataset"),
    (dict(window=0), "window must be >= 1"),
])
def test_bad_arguments(cluster, kwargs, message):
    args = dict(address=cluster.address, dataset=spec("Squares"))
    args.update(kwargs)
    with pytest.raises(dpex.DpexConfigError, match=message):
        dpex.RemoteDataLoader(**args)


@pytest.mark.parametrize("kwargs,message", [
    (dict(batch_size=-1), "batch_size should be a positive integer value, but got batch_size=-1"),
    (dict(batch_size=0), "batch_size should be a positive integer value, but got batch_size=0"),
    (dict(batch_size=2.5), "batch_size should be a positive integer value"),
    (dict(batch_sampler=[[0, 1]], drop_last=True), "batch_sampler option is mutually exclusive"),
    (dict(shuffle=True, sampler=[0, 1]), "sampler option is mutually exclusive with shuffle"),
    (dict(address="http://127.0.0.1:7070"), "bad address 'http://127.0.0.1:7070'"),
    (dict(address="127.0.0.1:99999"), "bad address"),
    (dict(num_consumers=0), "num_consumers must be an integer >= 1"),
    (dict(num_consumers=2, consumer_index=-1), "consumer_index must be in 0..1"),
    (dict(num_workers=-1), "num_workers must be >= 0"),
    (dict(processes=0), "processes must be >= 1"),
    (dict(timeout=0), "timeout must be > 0"),
    (dict(connect_timeout=-1), "connect_timeout must be >= 0"),
    (dict(compression="gzip"), "compression must be None, 'lz4' or 'zstd'"),
    (dict(collate_fn=5), "collate_fn must be callable"),
    (dict(worker_init_fn="init"), "worker_init_fn must be callable"),
])
@pytest.mark.parametrize("where", ["unreachable dispatcher", "embedded cluster"])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, message, where):
    """Before any RPC (an unreachable dispatcher, retried for a minute, would
    raise DpexConnectionError instead) and before any process starts."""
    args = dict(address="127.0.0.1:1" if where == "unreachable dispatcher" else None,
                dataset=spec("Squares"), connect_timeout=60)
    args.update(kwargs)
    children = children_of_this_process()
    with pytest.raises(ValueError, match=re.escape(message)):
        dpex.RemoteDataLoader(**args)
    assert children_of_this_process() == children


def children_of_this_process() -> set[int]:
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            pass  # a thread that ended meanwhile (its children went to another thread of ours)
    return pids


def test_torch_argument_checks_still_apply(cluster):
    with pytest.raises(ValueError, match="mutually exclusive"):
        dpex.RemoteDataLoader(cluster.address, spec("Squares"), shuffle=True,
                              sampler=SequentialSampler(range(3)))


def test_bad_dataset_spec():
    with pytest.raises(dpex.DpexConfigError, match="package.module:attr"):
        dpex.DatasetSpec("dpex.testing.datasets.Squares")
    with pytest.raises(dpex.DpexConfigError, match="import string or a callable"):
        dpex.DatasetSpec(42)


def test_job_name_conflict(cluster):
    a = dpex.RemoteDataLoader(cluster.address, spec("Squares", n=10), job_name="shared", timeout=30)
    try:
        same = dpex.RemoteDataLoader(cluster.address, spec("Squares", n=10), job_name="shared", timeout=30)
        assert same.job_id == a.job_id
        same.close()
        with pytest.raises(dpex.DpexConflictError, match="'shared' already exists with a different dataset"):
            dpex.RemoteDataLoader(cluster.address, spec("Squares", n=11), job_name="shared")
        with pytest.raises(dpex.DpexConflictError, match="different num_consumers"):
            dpex.RemoteDataLoader(cluster.address, spec("Squares", n=10), job_name="shared",
                                  num_consumers=2)
        # Every argument that changes batches or what workers do is part of the definition.
        for kwargs, names in [(dict(batch_size=20), "batch_size"), (dict(drop_last=True), "drop_last"),
                              (dict(persistent_workers=True), "persistent_workers"),
                              (dict(worker_init_fn=print), "worker_init_fn"),
                              (dict(collate_fn=list), "collate_fn"), (dict(compression="lz4"), "compression"),
                              (dict(batch_size=3, drop_last=True), "batch_size, drop_last")]:
            with pytest.raises(dpex.DpexConflictError, match=f"'shared' already exists with a different {names}[ ;]"):
                dpex.RemoteDataLoader(cluster.address, spec("Squares", n=10), job_name="shared", timeout=30,
                                      **kwargs)
        with pytest.raises(dpex.DpexConflictError) as info:  # the two values of each setting are named
            dpex.RemoteDataLoader(cluster.address, spec("Squares", n=10), job_name="shared", batch_size=3,
                                  drop_last=True, compression="lz4")
        assert ("different batch_size, drop_last, compression (batch_size=3 here, 1 in the job; drop_last=True "
                "here, False in the job; compression='lz4' here, '' in the job); use another job_name"
                in str(info.value))
    finally:
        a.close()


def test_a_second_loader_on_a_busy_consumer_is_refused_and_the_first_goes_on(cluster):
    slow = spec("Slow", n=40, delay_s=0.01)
    first = dpex.RemoteDataLoader(cluster.address, slow, batch_size=2, job_name="busy", timeout=30)
    second = dpex.RemoteDataLoader(cluster.address, slow, batch_size=2, job_name="busy", timeout=30)
    try:
        it = iter(first)
        got = [next(it)["y"].tolist() for _ in range(3)]
        with pytest.raises(dpex.DpexConflictError, match=r"consumer 0 of job 'busy' is in use by another loader "
                                                         r"\(ipv4:127\.0\.0\.1:\d+, since 20\d\d-"):
            iter(second)
        second.close()  # a refused loader's close leaves the other's epoch alone
        got += [b["y"].tolist() for b in it]
        assert got == [[i, i + 1] for i in range(0, 40, 2)]  # every batch once, to the first loader
    finally:
        first.close()
    with dpex.RemoteDataLoader(cluster.address, slow, batch_size=2, job_name="busy", timeout=30) as third:
        assert len(list(third)) == 20  # the first closed: its consumer is free at once


HOLDER = """
import sys, time
import dpex
loader = dpex.RemoteDataLoader(sys.argv[1], dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40), batch_size=2,
                               job_name="held-by-the-dead", timeout=30)
for i, batch in enumerate(loader):
    if i == 2:
        print("mid-epoch", flush=True)
        time.sleep(600)  # killed here
"""


def test_a_dead_loaders_consumer_is_free_within_seconds(cluster):
    from dpex.testing.cluster import kill_at
    kill_at(HOLDER, cluster.address)
    killed = time.monotonic()
    with dpex.RemoteDataLoader(cluster.address, spec("Squares", n=40), batch_size=2, job_name="held-by-the-dead",
                               timeout=30) as dl:

        def epoch():  # refused while the dispatcher still counts the dead loader as the holder
            try:
                return [y for b in dl for y in b["y"].tolist()]
            except dpex.DpexConflictError:
                return None
        assert wait_until(epoch, 30, "the dead loader's consumer to be free") == list(range(40))
    # At once when the dispatcher sees the connection end, else after claims.HELD_S of silence.
    assert time.monotonic() - killed < HELD_S + 5


def test_consumers_with_different_batch_counts_get_them_and_a_warning_naming_them(cluster):
    """As torch's DataLoader gives each rank what its sampler makes; a DDP step past the fewest would
    wait for ever, so the counts are named (even_batches evens them: tests/integration/test_even_batches.py)."""
    loaders = [dpex.RemoteDataLoader(cluster.address, spec("Squares", n=30), batch_size=4,
                                     sampler=SequentialSampler(range(n)), num_consumers=2,
                                     consumer_index=r, job_name="uneven", timeout=30)
               for r, n in enumerate([16, 12])]
    try:
        assert len(list(loaders[0])) == 4
        with pytest.warns(UserWarning, match=r"different numbers of batches in epoch 0 \(consumer 1: 3; consumer 0: 4\)"):
            assert len(list(loaders[1])) == 3
    finally:
        for loader in loaders:
            loader.close()


def test_timeout_names_the_missing_batches():
    # A cluster without workers: nothing can arrive.
    with dpex.LocalCluster(num_workers=0) as c:
        with dpex.RemoteDataLoader(c.address, Squares(8), batch_size=4, timeout=1.0) as dl:
            with pytest.raises(dpex.DpexTimeoutError, match=r"2 batches missing \(seq 0, 1\); workers alive: 0"):
                list(dl)


def test_a_closed_loader_refuses_to_iterate(cluster):
    dl = dpex.RemoteDataLoader(cluster.address, spec("Squares", n=4), batch_size=2, timeout=30)
    dl.close()
    dl.close()  # idempotent
    with pytest.raises(dpex.DpexConfigError, match="closed"):
        iter(dl)


def make_files(root, n):
    root.mkdir()
    for i in range(n):
        (root / f"{i:04d}.txt").touch()


@pytest.mark.parametrize("sizes,fingerprinted,late", [((50, 100), False, False), ((100, 50), False, False),
                                                     ((60, 60), True, False), ((50, 100), False, True)])
def test_workers_whose_data_disagree_fail_the_epoch_naming_both(tmp_path, sizes, fingerprinted, late):
    make_files(tmp_path / "a", sizes[0])
    make_files(tmp_path / "b", sizes[1])
    if fingerprinted:  # same count, other files
        (tmp_path / "b" / "0000.txt").rename(tmp_path / "b" / "9999.txt")
    spec = dpex.DatasetSpec("dpex.testing.datasets:FilesIn", root="$NODE_DATA", fingerprinted=fingerprinted)
    with test_cluster(num_workers=0) as c:
        a, = c.add_workers(1, env={"NODE_DATA": str(tmp_path / "a")})
        if not late:  # both there when the loader starts: it refuses at once
            b, = c.add_workers(1, env={"NODE_DATA": str(tmp_path / "b")})
            with pytest.raises(dpex.DpexConfigError, match="workers disagree about the dataset") as info:
                dpex.RemoteDataLoader(c.address, spec, batch_size=10, timeout=60)
        else:  # b joins mid-epoch: its first batch fails the epoch
            with dpex.RemoteDataLoader(c.address, spec, batch_size=1, timeout=60) as dl:
                it = iter(dl)
                next(it)
                b, = c.add_workers(1, env={"NODE_DATA": str(tmp_path / "b")})
                with pytest.raises(dpex.DpexConfigError, match="workers disagree about the dataset") as info:
                    for _ in it:
                        pass
    message = str(info.value)
    assert a.address in message and b.address in message
    if fingerprinted:
        assert message.count("fingerprint '") == 2
    else:
        assert "50 samples" in message or "has 50" in message
        assert "100" in message
