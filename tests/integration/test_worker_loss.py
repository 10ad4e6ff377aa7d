"""A worker lost mid-epoch: every planned batch still arrives exactly once, in order."""
import signal

import pytest

import dpex
from dpex.testing import test_cluster

N, B = 240, 4
EXPECTED = [list(range(i, i + B)) for i in range(0, N, B)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_lost_worker_mid_epoch_loses_and_duplicates_nothing(sig):
    with test_cluster(num_workers=3) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=60) as dl:
            for epoch in range(2):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if epoch == 0 and i == 10:
                        victim = c.workers[0]
                        victim.process.send_signal(sig)
                assert got == EXPECTED  # complete, no duplicates, in plan order
        if sig == signal.SIGSTOP:
            victim.process.send_signal(signal.SIGCONT)


def test_a_worker_that_joins_mid_epoch_takes_work_at_once():
    with test_cluster(num_workers=1) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Where", n=400)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=2, timeout=60) as dl:
            pids, ids = [], []
            for i, batch in enumerate(dl):
                pids.append(batch["pid"][0].item())
                ids += batch["i"].tolist()
                if i == 5:
                    c.add_workers(1)
            assert ids == list(range(400))
            assert set(pids) - set(pids[:6]), "the new worker produced no batch"


def test_a_worker_restarted_on_the_same_address_rejoins_cleanly():
    with test_cluster(num_workers=2) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Where", n=240)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=60) as dl:
            for epoch in range(2):
                ids, pids = [], set()
                for i, batch in enumerate(dl):
                    ids += batch["i"].tolist()
                    pids |= set(batch["pid"].tolist())
                    if epoch == 0 and i == 10:
                        old = c.workers[0].address
                        assert c.restart_worker(0).address == old
                assert ids == list(range(240))
        restarted = c.workers[0]
        assert restarted.process.poll() is None


def test_sigterm_drains_a_worker_without_waiting_for_its_heartbeat_timeout():
    # A heartbeat timeout far beyond the loader's timeout: only the drain can explain a finished epoch.
    with test_cluster(num_workers=2, heartbeat_timeout_s=60.0) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=20) as dl:
            got = []
            for i, batch in enumerate(dl):
                got.append(batch["y"].tolist())
                if i == 10:
                    c.kill_worker(0, signal.SIGTERM)  # waits for it to exit
                    assert c.workers[0].process.returncode == 0
            assert got == EXPECTED
        assert "is leaving; re-planning its" in c.dispatcher.log_tail(50)
