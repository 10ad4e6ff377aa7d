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
