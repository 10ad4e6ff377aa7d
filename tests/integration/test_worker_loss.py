"""A worker lost mid-epoch: every planned batch still arrives exactly once, in order."""
import signal
import time

import cloudpickle
import grpc
import pytest

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.version import versions
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import channel
from dpex.testing import descendants, pids_alive, test_cluster, wait_until

N, B = 240, 4
EXPECTED = [list(range(i, i + B)) for i in range(0, N, B)]


# A killed worker is marked lost when a trainer reports its broken stream (its port refuses
# connections): the heartbeat timeout, far beyond the loader's timeout, cannot explain a finished
# epoch. A frozen one still accepts connections: it is lost at its heartbeat timeout.
@pytest.mark.parametrize("sig,heartbeat_timeout_s", [(signal.SIGKILL, 60.0), (signal.SIGSTOP, None)],
                         ids=["killed", "frozen"])
def test_lost_worker_mid_epoch_loses_and_duplicates_nothing(sig, heartbeat_timeout_s):
    hb = {} if heartbeat_timeout_s is None else dict(heartbeat_timeout_s=heartbeat_timeout_s)
    with test_cluster(num_workers=3, **hb) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=20) as dl:
            for epoch in range(2):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if epoch == 0 and i == 10:
                        victim = c.workers[0]
                        victim.process.send_signal(sig)
                assert got == EXPECTED  # complete, no duplicates, in plan order
        log = c.dispatcher.log_tail(80)
        if sig == signal.SIGKILL:
            assert "worker is gone (a trainer's stream to it broke and its port refuses connections" in log
            assert "missed its heartbeat timeout" not in log
        if sig == signal.SIGSTOP:
            assert "missed its heartbeat timeout" in log
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


def test_a_reported_worker_that_still_accepts_connections_is_kept():
    with test_cluster(num_workers=1, heartbeat_timeout_s=60.0) as c:
        with channel(c.address) as ch:
            stub = dgrpc.DispatcherStub(ch)
            for address in (c.workers[0].address, "127.0.0.1:1"):  # a live worker; no worker at all
                answer = stub.ReportWorker(dpb.ReportWorkerRequest(address=address, error="test"), timeout=10)
                assert answer.lost is False
            status = stub.GetStatus(dpb.GetStatusRequest(), timeout=10)
        assert [w.state for w in status.workers] == ["alive"]


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
        drained = c.workers[0].log_tail(200)
        assert "shutting down" in drained and " ERROR " not in drained  # a drain is no error


def test_sigterm_exits_within_the_drain_timeout_while_a_batch_is_running(tmp_path):
    """A batch takes 25 s (50 samples x 0.5 s); SIGTERM ends the worker within
    --drain-timeout, its batch processes killed, and the epoch loses nothing."""
    slow = tmp_path / "slow"
    slow.touch()
    with test_cluster(num_workers=2, heartbeat_timeout_s=60.0, worker_flags=("--drain-timeout", "1")) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:SlowWhile", n=200, path=str(slow), delay_s=0.5)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=50, timeout=60) as dl:
            it = iter(dl)  # the plan is submitted: both workers start a 25 s batch

            def running():  # the index of a worker running a batch (one may hold both splits)
                with channel(c.address) as ch:
                    status = dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=5)
                busy = {w.address for w in status.workers if w.load.running_batches}
                return next((i + 1 for i, w in enumerate(c.workers) if w.address in busy), None)
            index = wait_until(running, 60, "a worker to run a batch") - 1
            victim = c.workers[index]
            pids = descendants(victim.process.pid)
            start = time.monotonic()
            c.kill_worker(index, signal.SIGTERM)
            took = time.monotonic() - start
            assert victim.process.returncode == 0
            assert took < 1 + 2.5, f"drained in {took:.1f}s"  # --drain-timeout 1; the batch needed 25 s
            # Its batch processes are gone (multiprocessing's resource tracker exits right after it).
            assert pids and wait_until(lambda: pids_alive(pids) == [], 10, "the worker's processes to exit")
            slow.unlink()  # from now on batches are quick
            got = [batch["y"].tolist() for batch in it]
        assert got == [list(range(i, i + 50)) for i in range(0, 200, 50)]


def test_a_lost_workers_split_names_what_was_delivered_to_its_new_owner():
    """The dispatcher's side of a take-over, through its gRPC API: the new owner
    learns which batches the trainer acknowledged, so it does not make them again."""
    with test_cluster(num_workers=0, split_size_batches=4) as c, grpc.insecure_channel(c.address) as ch:
        d = dgrpc.DispatcherStub(ch)
        ra = d.RegisterWorker(dpb.RegisterWorkerRequest(versions=versions(), address="127.0.0.1:1"))
        rb = d.RegisterWorker(dpb.RegisterWorkerRequest(versions=versions(), address="127.0.0.1:2"))
        a, b = ra.worker_id, rb.worker_id
        job = dpb.JobDef(dataset=cloudpickle.dumps(dpex.DatasetSpec("dpex.testing.datasets:Squares", n=16)),
                         num_consumers=1)
        made = d.GetOrCreateJob(dpb.GetOrCreateJobRequest(job=job))
        job_id, key = made.job_id, made.job_key
        d.SubmitPlan(dpb.SubmitPlanRequest(job_id=job_id, job_key=key, consumer_index=0, epoch=0, base_seed=1,
                                           batches=[dpb.IndexBatch(indices=[i]) for i in range(8)]))
        first = d.WorkerHeartbeat(dpb.WorkerHeartbeatRequest(worker_id=a, worker_key=ra.worker_key,
                                                             want_splits=1)).splits
        assert [(s.first_seq, list(s.delivered_seqs)) for s in first] == [(0, [])]
        d.SyncConsumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=key, consumer_index=0, epoch=0,
                                               delivered_seqs=[0, 1]))
        d.DeregisterWorker(dpb.DeregisterWorkerRequest(worker_id=a, worker_key=ra.worker_key))
        taken = d.WorkerHeartbeat(dpb.WorkerHeartbeatRequest(worker_id=b, worker_key=rb.worker_key,
                                                             want_splits=2)).splits
        assert sorted((s.first_seq, list(s.delivered_seqs)) for s in taken) == [(0, [0, 1]), (4, [])]


def test_batches_abandoned_by_a_drain_are_no_error():
    with test_cluster(num_workers=1, heartbeat_timeout_s=60.0) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=4, delay_s=60)
        loader = dpex.RemoteDataLoader(c.address, spec, batch_size=1, timeout=120)
        it = iter(loader)
        with channel(c.address) as ch:
            stub = dgrpc.DispatcherStub(ch)
            # Reported with a heartbeat: the worker is making a batch that takes a minute.
            wait_until(lambda: stub.GetStatus(dpb.GetStatusRequest(), timeout=10).workers[0].load.running_batches,
                       30, "a batch to be running")
        c.kill_worker(0, signal.SIGTERM)  # drains for --drain-timeout (2 s), then stops its batch processes
        log = c.workers[0].log_tail(200)
        assert "batch abandoned: the pool is closing" in log and " ERROR " not in log
        del it
        loader.close()

