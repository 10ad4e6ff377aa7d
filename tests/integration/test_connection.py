"""Connection failures are loud at once and final on time; peers that come
back are found again within seconds."""
import logging
import time

import pytest

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import call, channel
from dpex.testing import free_port, test_cluster, wait_until

SQUARES = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)


def test_a_refused_address_is_reported_at_the_first_attempt(caplog):
    address = f"127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="dpex")
    start = time.monotonic()
    with pytest.raises(dpex.DpexConnectionError, match=f"cannot reach dispatcher {address}.*unreachable for 4s"):
        dpex.RemoteDataLoader(address, SQUARES, connect_timeout=4)
    warnings = [r for r in caplog.records if "cannot reach" in r.getMessage()]
    assert len(warnings) == 1  # once, not at every retry
    message = warnings[0].getMessage()
    assert address in message and "retrying for 4s" in message
    assert "refused" in message.lower() or "connect" in message.lower()  # the cause
    assert warnings[0].created - (time.time() - (time.monotonic() - start)) < 2.0  # at the first attempt


def test_a_dead_dispatcher_ends_the_epoch_and_the_next_iter_on_one_deadline():
    with test_cluster(num_workers=1) as c:
        # Once reached, the dispatcher's outage is ridden out as long as the loader's timeout allows.
        loader = dpex.RemoteDataLoader(c.address, SQUARES, batch_size=2, connect_timeout=2, timeout=5)
        it = iter(loader)
        got = [next(it) for _ in range(3)]
        c.stop_dispatcher()  # for good: no --work-dir, nothing comes back
        killed = time.monotonic()
        with pytest.raises(dpex.DpexConnectionError):
            got += list(it)  # the epoch (or its last report) finds the dispatcher gone
            iter(loader)
        with pytest.raises(dpex.DpexConnectionError, match="cannot reach dispatcher"):
            iter(loader)
        # One outage, one deadline: 5 s from the first failed call (each call
        # starting its own would take 10 s or more).
        assert time.monotonic() - killed < 8.5
        loader.close()


@pytest.mark.parametrize("timeout", [None, 30])
def test_a_trainer_rides_out_a_dispatcher_outage_longer_than_its_connect_timeout(tmp_path, caplog, timeout):
    slow = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=120, delay_s=0.01)
    with test_cluster(num_workers=2, work_dir=str(tmp_path / "journal")) as c:
        with dpex.RemoteDataLoader(c.address, slow, batch_size=2, connect_timeout=2, timeout=timeout) as dl:
            got = []
            with caplog.at_level(logging.WARNING, logger="dpex.rpc"):
                for i, batch in enumerate(dl):
                    got += batch["y"].tolist()
                    if i == 3:
                        c.stop_dispatcher()
                        # The outage (the scenario, not a wait for a condition) outlasts connect_timeout,
                        # while the loader's threads keep calling the dispatcher.
                        time.sleep(4.0)
                        c.start_dispatcher()  # from its journal
            assert got == list(range(120))  # every batch once, in order, through the outage
            said = [r.getMessage() for r in caplog.records]
            assert any("cannot reach dispatcher" in m for m in said)
            assert any(m.startswith(f"reached dispatcher {c.address} again after an outage of") for m in said)
            assert sorted(y for b in dl for y in b["y"].tolist()) == list(range(120))  # and on
        for worker in c.workers:  # the workers say the outage once when it starts, and when it ends
            log = worker.log_tail(200)
            assert log.count("cannot reach dispatcher") == 1 and "still retrying" not in log
            assert f"reached dispatcher {c.address} again after an outage of" in log


def test_workers_find_a_dispatcher_that_comes_back_within_seconds():
    with test_cluster(num_workers=2) as c:
        c.stop_dispatcher()
        # Long enough an outage for gRPC's default reconnect backoff (x1.6 per
        # try, up to 120 s) to wait over 5 s more after the dispatcher is back.
        time.sleep(12)
        c.start_dispatcher()
        back = time.monotonic()

        def alive():
            with channel(c.address) as ch:
                status = call(dgrpc.DispatcherStub(ch).GetStatus, dpb.GetStatusRequest(),
                              target="dispatcher", timeout_s=5, retry_for_s=5)
            return sum(w.state == "alive" for w in status.workers) == 2
        wait_until(alive, 30, "the workers to register again")
        assert time.monotonic() - back <= 5.0
        with dpex.RemoteDataLoader(c.address, SQUARES, batch_size=4, timeout=30) as loader:
            assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(40))


def test_a_dispatcher_whose_handshake_takes_seconds_is_reached_at_the_first_attempt(caplog):
    # A loaded host or a slow link: its HTTP/2 handshake takes 1.5 s. Each connection attempt was given
    # 100 ms (gRPC's MIN_CONNECT_TIMEOUT was set with the backoff), and never more than the backoff's 1 s
    # cap: such a dispatcher was never reached, and one at 300 ms only after warnings of an outage.
    import subprocess
    import sys
    from torch.utils.data import DataLoader
    from dpex.testing.datasets import Squares
    from dpex.testing.servers import slow_link
    caplog.set_level(logging.WARNING, logger="dpex")
    with test_cluster(num_workers=1) as c, slow_link(c.address, 1.5) as far:
        done = subprocess.run([sys.executable, "-m", "dpex.cmd.status", "status", "--dispatcher", far],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "JOBS" in done.stdout, done.stderr
        assert "timed out" not in done.stderr and "outage" not in done.stderr, done.stderr
        with dpex.RemoteDataLoader(far, SQUARES, batch_size=4, connect_timeout=10, timeout=30) as loader:
            got = [b["y"].tolist() for b in loader]
        assert got == [b["y"].tolist() for b in DataLoader(Squares(40), batch_size=4)]
    assert not [r.getMessage() for r in caplog.records if "reach" in r.getMessage()]
