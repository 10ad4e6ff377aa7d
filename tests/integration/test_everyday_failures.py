"""The polite and everyday failures, on real daemons: a dispatcher stopped with
SIGTERM and started again, a trainer killed and its command run again at once,
the embedded cluster's worker killed, a Ctrl-C to the process group of a
trainer that ignores it, a wrong address. Each ends in every batch delivered
exactly once, or in a clear error within seconds: none hangs."""
import os
import signal
import subprocess
import sys
import time

import pytest

import dpex
from dpex.testing import test_cluster
from dpex.testing.cluster import kill_at
from dpex.testing.datasets import Squares

N, B = 200, 4
EXPECTED = [list(range(i, i + B)) for i in range(0, N, B)]
SLOW = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)


@pytest.mark.timeout(180)
def test_sigterm_and_restart_mid_epoch_again_and_again_delivers_each_batch_once(tmp_path):
    # timeout=None: a trainer that lost its control stream would wait for ever (the pytest timeout says so).
    with test_cluster(num_workers=2, work_dir=str(tmp_path)) as c:
        with dpex.RemoteDataLoader(c.address, SLOW, batch_size=B, timeout=None, job_name="polite") as dl:
            for epoch in range(2):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if epoch == 0 and i in (5, 15, 25, 35):
                        c.restart_dispatcher(signal.SIGTERM)
                assert got == EXPECTED
        logs = [os.path.join(c.log_dir, f) for f in os.listdir(c.log_dir) if f.startswith("dispatcher-")]
        log = "".join(open(path).read() for path in logs)  # each dispatcher started logs to a file of its own
        assert log.count("shutting down") == 4
        assert "unexpected error" not in log and "closed file" not in log, log


HOLDER = """
import sys, time
import dpex
loader = dpex.RemoteDataLoader(sys.argv[1], dpex.DatasetSpec("dpex.testing.datasets:Slow", n=200, delay_s=0.005),
                               batch_size=4, job_name="rerun", timeout=30)
for i, batch in enumerate(loader):
    if i == 5:
        print("mid-epoch", flush=True)
        time.sleep(600)  # killed here
"""


@pytest.mark.parametrize("after_s", [0.2, 5.0])
def test_a_killed_trainer_run_again_at_once_gets_its_whole_epoch(after_s):
    # The dispatcher's own consumer timeout (60 s), not the short one of other tests: the rerun must not
    # depend on the dead trainer's consumer being released for its silence.
    with test_cluster(num_workers=2, consumer_timeout_s=60.0) as c:
        kill_at(HOLDER, c.address)
        time.sleep(after_s)  # the scenario itself: a scheduler runs the command again after this long
        started = time.monotonic()
        with dpex.RemoteDataLoader(c.address, SLOW, batch_size=B, job_name="rerun", timeout=30) as dl:
            assert [b["y"].tolist() for b in dl] == EXPECTED  # the same epoch 0, every batch, once
        assert time.monotonic() - started < 30


def test_a_live_holder_still_refuses_a_newcomer_after_the_claim_time(cluster):
    slow = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=400, delay_s=0.02)
    first = dpex.RemoteDataLoader(cluster.address, slow, batch_size=2, job_name="held", timeout=30)
    try:
        it = iter(first)
        next(it)
        with pytest.raises(dpex.DpexConflictError, match="in use by another loader"):
            with dpex.RemoteDataLoader(cluster.address, slow, batch_size=2, job_name="held", timeout=30) as second:
                iter(second)
        assert len([next(it) for _ in range(5)]) == 5  # the holder goes on
    finally:
        first.close()


def _embedded_worker(loader):
    return loader._remote._session.cluster._cluster._cluster.workers[0].process


@pytest.mark.timeout(120)
def test_a_killed_embedded_worker_is_started_again_and_the_epoch_completes_once():
    dl = dpex.DpexDataLoader(Squares(N), distribute_mode=True, batch_size=B, num_workers=2)
    try:
        for epoch in range(2):
            got = []
            for i, batch in enumerate(dl):
                got.append(batch["y"].tolist())
                if i == 10:
                    killed = _embedded_worker(dl)
                    os.kill(killed.pid, signal.SIGKILL)
            assert got == EXPECTED
            assert _embedded_worker(dl).pid != killed.pid
    finally:
        dl.close()


@pytest.mark.timeout(120)
def test_an_embedded_worker_that_keeps_dying_fails_in_torchs_words_within_seconds():
    from dpex.launch.embedded import MAX_RESPAWNS
    dl = dpex.DpexDataLoader(Squares(N), distribute_mode=True, batch_size=1, num_workers=1)
    try:
        it = iter(dl)
        next(it)
        pids = set()
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Killed\.") as info:
            for _ in it:
                worker = _embedded_worker(dl)
                if worker.pid not in pids:  # each new worker, once it served a batch
                    pids.add(worker.pid)
                    killed_at = time.monotonic()
                    os.kill(worker.pid, signal.SIGKILL)
        assert time.monotonic() - killed_at < 10
        assert len(pids) == MAX_RESPAWNS + 1
        assert isinstance(info.value, dpex.DpexWorkerError)
    finally:
        dl.close()


IGNORES_SIGINT = """
import signal, sys, torch, dpex
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a background job of a shell
class Squares(torch.utils.data.Dataset):
    def __len__(self): return 200
    def __getitem__(self, i): return i
loader = dpex.DpexDataLoader(Squares(), distribute_mode=True, batch_size=4, num_workers=2, timeout=60)
got = []
for epoch in range(2):
    for i, batch in enumerate(loader):
        got += batch.tolist()
        if epoch == 0 and i == 10:
            print("mid-epoch", flush=True)
            sys.stdin.readline()  # the test sends SIGINT to the whole group, then a line
print(sorted(got) == sorted(list(range(200)) * 2), flush=True)
"""


@pytest.mark.timeout(120)
def test_sigint_to_the_group_of_a_trainer_that_ignores_it_leaves_its_embedded_cluster_alone(tmp_path):
    trainer = subprocess.Popen([sys.executable, "-c", IGNORES_SIGINT], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert trainer.stdout.readline() == "mid-epoch\n"
        os.killpg(trainer.pid, signal.SIGINT)
        trainer.stdin.write("go on\n")
        trainer.stdin.flush()
        out, err = trainer.communicate(timeout=60)
        assert out == "True\n", err
        assert "failed" not in err, err
    finally:
        trainer.kill()
        trainer.wait()


def test_a_dispatcher_without_live_workers_fails_the_epoch_within_connect_timeout():
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, SLOW, batch_size=B, timeout=None, connect_timeout=3) as dl:
            it = iter(dl)
            next(it)
            c.kill_worker(0)
            started = time.monotonic()
            with pytest.raises(dpex.DpexConnectionError, match="has had no live worker for"):
                for _ in it:
                    pass
            assert time.monotonic() - started < 3 + 10  # its loss is seen, then connect_timeout


@pytest.mark.parametrize("dataset", [Squares(N), SLOW], ids=["instance", "spec"])
def test_a_wrong_address_fails_within_the_loaders_timeout(dataset):
    started = time.monotonic()
    with pytest.raises(dpex.DpexConnectionError, match="cannot reach dispatcher 127.0.0.1:1"):
        dpex.RemoteDataLoader("127.0.0.1:1", dataset, timeout=2)
    assert time.monotonic() - started < 2 + 3  # not connect_timeout's 30 s


def test_a_worker_slow_to_build_the_dataset_fails_the_constructor_within_the_loaders_timeout(tmp_path):
    # The constructor asks a worker to build the dataset (Inspect) and waited up to 300 s for it,
    # whatever the loader's timeout (issue 61: a loader given timeout=15 hung for 300 s).
    hold = tmp_path / "hold"
    hold.write_text("")
    with test_cluster(num_workers=1) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:SlowToBuild", 8, str(hold))
        started = time.monotonic()
        with pytest.raises(dpex.DpexTimeoutError, match=r"worker 127\.0\.0\.1:\d+"):
            dpex.RemoteDataLoader(c.address, spec, batch_size=2, timeout=2)
        assert time.monotonic() - started < 2 + 5
        hold.unlink()  # the worker's build ends: nothing is left waiting
