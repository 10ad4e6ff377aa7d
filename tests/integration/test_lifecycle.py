"""The embedded default starts and stops its own cluster; nothing is left
behind on close(), on garbage collection mid-epoch, or on Ctrl-C."""
import gc
import glob
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

import dpex
from dpex.launch import embedded
from dpex.testing import descendants, pids_alive, test_cluster, wait_until
from dpex import shm


def dpex_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("dpex")]


def test_local_cluster_close_stops_every_process():
    before = set(descendants(os.getpid()))
    cluster = dpex.LocalCluster(num_workers=2, processes=2)
    started = [p for p in descendants(os.getpid()) if p not in before]
    assert len(started) >= 1 + 2 + 2 * 2  # dispatcher, workers, their batch processes
    cluster.close()
    cluster.close()
    assert pids_alive(started) == []


def test_a_worker_starting_when_the_cluster_stops_is_stopped_and_none_starts_after():
    cluster = dpex.LocalCluster(num_workers=1)
    spawned = cluster._spawn("worker", cluster._worker_args())  # what respawn_worker starts, not serving yet
    cluster.close()  # at interpreter exit, the finalizer: it may come while a worker starts
    assert spawned[0].poll() is not None
    with pytest.raises(dpex.DpexError):
        cluster._serving("worker", spawned, cluster.workers.append)
    with pytest.raises(dpex.DpexError, match="stopping"):
        cluster.respawn_worker(0)
    assert cluster.workers[0].process.poll() is not None


def test_the_embedded_cluster_does_not_take_its_own_stop_for_a_death(monkeypatch):
    # At interpreter exit the cluster's finalizer may stop the daemons before stop_embedded()
    # stops the thread that watches them: it started a worker again, and exit waited for it.
    monkeypatch.setattr(embedded, "SUPERVISE_S", 3600.0)  # the test calls _supervise itself
    lease = embedded.embedded(1, None, "spawn")
    try:
        lease.address
        owner = lease._cluster
        owner._cluster.close()
        owner._supervise()
        assert owner._respawns == 0 and lease.failure() is None
    finally:
        lease.close()
        embedded.stop_embedded()


def test_close_removes_the_handoff_files_of_a_worker_killed_with_sigkill():
    with test_cluster(num_workers=2) as c:  # every frame goes through /dev/shm
        with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=64),
                                   batch_size=4) as dl:
            assert len(list(dl)) == 16
        directories = [os.path.join(shm.SHM, f"dpex-{w.process.pid}") for w in c.workers]
        assert all(os.path.isdir(d) for d in directories)
        c.kill_worker(0)  # it cannot remove its own directory: the cluster's close does, or any other Dpex
        # process that starts meanwhile (another test's, beside this one): either way, none is left
    assert not any(os.path.exists(d) for d in directories)


def test_embedded_default_runs_and_cleans_up_on_gc_mid_epoch(monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_LINGER_S", 0.5)
    before = set(descendants(os.getpid()))
    loader = dpex.RemoteDataLoader(None, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=64),
                                   batch_size=4, processes=1, timeout=60)
    it = iter(loader)
    assert next(it)["y"].tolist() == [0, 1, 2, 3]
    started = [p for p in descendants(os.getpid()) if p not in before]
    assert started and dpex_threads()
    del loader, it
    gc.collect()
    # The embedded cluster waits EMBEDDED_LINGER_S for another loader of this process, then stops.
    wait_until(lambda: pids_alive(started) == [], 30, "the embedded cluster to stop")
    wait_until(lambda: not dpex_threads(), 10, "dpex threads to end")


def test_the_loaders_of_a_process_share_one_embedded_cluster_started_in_the_background(monkeypatch):
    monkeypatch.setattr(embedded, "EMBEDDED_LINGER_S", 60.0)
    before = set(descendants(os.getpid()))
    train = dpex.DpexDataLoader(list(range(10)), distribute_mode=True, batch_size=4, num_workers=1)
    assert train._remote._session.stub is None  # constructed without waiting for the daemons: none contacted yet
    assert [b.tolist() for b in train] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    started = [p for p in descendants(os.getpid()) if p not in before]
    val = dpex.DpexDataLoader(list(range(20, 23)), distribute_mode=True, batch_size=2, num_workers=1)
    assert val.dispatcher_address == train.dispatcher_address  # the same dispatcher
    assert [b.tolist() for b in val] == [[20, 21], [22]]
    train.close()
    val.close()
    again = dpex.DpexDataLoader(list(range(3)), distribute_mode=True, batch_size=3, num_workers=1)
    assert [b.tolist() for b in again] == [[0, 1, 2]]  # within the linger: the same cluster again
    assert [p for p in descendants(os.getpid()) if p not in before and p not in started] == []
    again.close()
    embedded.stop_embedded()  # as at interpreter exit
    assert pids_alive(started) == []


SCRIPT = textwrap.dedent("""
    import os, signal, sys
    # A trainer at a terminal: a suite started in the background by a shell would hand on SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import dpex
    from dpex.testing import descendants
    loader = dpex.RemoteDataLoader(None, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=10**4),
                                   batch_size=2, processes=1, multiprocessing_context=sys.argv[1])
    for i, batch in enumerate(loader):
        if i == 3:
            print(" ".join(map(str, descendants(os.getpid()))), flush=True)
""")


def all_exit(pids: list[int]) -> None:
    """Waits for the processes to exit; names those that do not."""
    try:
        wait_until(lambda: pids_alive(pids) == [], 20, "the cluster's processes to exit")
    except TimeoutError:
        left = {p: open(f"/proc/{p}/cmdline").read().replace("\0", " ")[:120] for p in pids_alive(pids)}
        pytest.fail(f"still running: {left}")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_ctrl_c_in_the_trainer_stops_the_embedded_cluster(tmp_path, context):
    stacks = tmp_path / "stacks"
    with open(stacks, "w") as err:
        trainer = subprocess.Popen([sys.executable, "-X", "faulthandler", "-c", SCRIPT, context], stdout=subprocess.PIPE,
                                   stderr=err, text=True)
        children = [int(p) for p in trainer.stdout.readline().split()]
        assert len(children) >= 3
        trainer.send_signal(signal.SIGINT)
        # Out in about half a second here; the bound leaves room for a loaded machine
        # (before its worker stopped without draining, it took 10 s).
        try:
            assert trainer.wait(5) != 0
        except subprocess.TimeoutExpired:
            trainer.send_signal(signal.SIGABRT)  # faulthandler: where every thread of it stands
            trainer.wait(10)
            pytest.fail("the trainer did not exit within 5 s of SIGINT:\n" + stacks.read_text()[-6000:])
    all_exit(children)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_killed_trainer_takes_its_cluster_along(context):
    trainer = subprocess.Popen([sys.executable, "-c", SCRIPT, context], stdout=subprocess.PIPE, text=True)
    children = [int(p) for p in trainer.stdout.readline().split()]
    # Read while the trainer lives: once it is dead, any cluster that starts (another
    # test's, in parallel) may remove its directory before this one looks.
    made = glob.glob(os.path.join(tempfile.gettempdir(), f"dpex-cluster-{trainer.pid}-*"))
    assert len(made) == 1
    trainer.kill()
    trainer.wait()
    all_exit(children)
    # Its daemons removed their own directories; the cluster's log directory,
    # the killed trainer's, goes when the next cluster starts.
    dpex.LocalCluster(num_workers=0).close()
    assert not os.path.exists(made[0])
    assert not [p for p in children if glob.glob(os.path.join(tempfile.gettempdir(), f"dpex-worker-{p}-*"))]


def test_a_worker_removes_the_definitions_of_jobs_the_dispatcher_collected():
    # A long-lived worker kept job-<id>.pb of every job it ever served: 413 files
    # after 409 collected jobs, 2 MB each for a dataset shipped by value (issue 61).
    import tempfile
    with test_cluster(num_workers=1, dispatcher_flags=("--job-gc-timeout", "1")) as c:
        (job_dir,) = glob.glob(os.path.join(tempfile.gettempdir(), f"dpex-worker-{c.workers[0].process.pid}-*"))

        def kept() -> list[str]:
            return [f for f in os.listdir(job_dir) if f.startswith("job-") and f.endswith(".pb")]
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=8)
        done = []
        for n in range(3):  # closed: collected a second after
            with dpex.RemoteDataLoader(c.address, spec, batch_size=2, job_name=f"done-{n}", timeout=60) as dl:
                assert len(list(dl)) == 4
                done.append(f"job-{dl.job_id}.pb")
        assert set(done) <= set(kept())
        wait_until(lambda: not set(done) & set(kept()), 30, "the collected jobs' definitions to go")
        with dpex.RemoteDataLoader(c.address, spec, batch_size=2, job_name="done-0", timeout=60) as dl:
            assert len(list(dl)) == 4  # the name again: a new job, its definition fetched again
            assert f"job-{dl.job_id}.pb" in kept()


def test_a_loader_dropped_while_its_epoch_is_read_gives_the_whole_epoch(cluster):
    # `for b in DataLoader(...)`: torch's iterator keeps its loader alive; so does a Dpex epoch (the loader
    # is not collected, its streams not closed, mid-epoch). torch is the oracle.
    from torch.utils.data import DataLoader
    from dpex.testing.datasets import Squares
    got = [b["y"].tolist() for b in dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec(
        "dpex.testing.datasets:Squares", n=12), batch_size=4, timeout=30)]
    gc.collect()
    assert got == [b["y"].tolist() for b in DataLoader(Squares(12), batch_size=4)]
