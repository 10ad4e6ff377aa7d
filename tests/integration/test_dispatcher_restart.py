"""kill -9 of the dispatcher mid-epoch: with --work-dir it replays its journal
and the epoch completes exactly once; without, trainers get a clear error."""
import random
import subprocess
import sys
import os

import pytest

import dpex
from dpex.testing import status_tables, test_cluster

N, B = 200, 4
EXPECTED = [list(range(i, i + B)) for i in range(0, N, B)]
SPEC = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)


def test_restart_with_work_dir_completes_the_epoch_exactly_once(tmp_path):
    with test_cluster(num_workers=2, work_dir=str(tmp_path)) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, timeout=60, job_name="survivor") as dl:
            for epoch in range(2):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if epoch == 0 and i in (10, 30):  # twice, the second time after the first restart
                        c.restart_dispatcher()
                assert got == EXPECTED
        status = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dpex"), "status",
                                 "--dispatcher", c.address], capture_output=True, text=True)
        job = next(j for j in status_tables(status.stdout)["JOBS"] if j["NAME"] == "survivor")
        assert job["PLANNED"] == job["DELIVERED"] == str(2 * len(EXPECTED))  # over both epochs
        assert "WORKERS (2 alive, 0 lost, 0 left)" in status.stdout


def test_restart_without_work_dir_fails_clearly(tmp_path):
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, timeout=60) as dl:
            with pytest.raises(dpex.DpexNotFoundError, match="restarted without --work-dir"):
                for i, _ in enumerate(dl):
                    if i == 5:
                        c.restart_dispatcher()


def test_kill_at_random_points_with_snapshots_every_few_records_loses_nothing(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kills = {(epoch, rng.randrange(len(EXPECTED))) for epoch in range(3) for _ in range(2)}
    # A snapshot every kilobyte of log: a kill often lands in or next to one.
    with test_cluster(num_workers=2, work_dir=str(tmp_path), dispatcher_flags=("--journal-compact-kb", "1")) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, timeout=60, job_name="kills") as dl:
            for epoch in range(3):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if (epoch, i) in kills:
                        c.restart_dispatcher()
                assert got == EXPECTED, f"seed {seed}"
        files = sorted(os.listdir(tmp_path))
        assert "snapshot" in files and len([f for f in files if f.endswith(".log")]) == 1, files
        assert sum(os.path.getsize(os.path.join(tmp_path, f)) for f in files if f != "plans") < 16 << 10


def test_no_answer_goes_out_before_the_updates_it_reflects_are_durable(tmp_path):
    """Group commit: updates are fsync'd in groups, and each call (a short one,
    a heartbeat's long poll) is answered only once they are on disk."""
    import threading

    import grpc

    from dpex.config import DispatcherConfig
    from dpex.dispatcher.server import DispatcherServer
    from dpex.plan import samplers
    from dpex.proto import dispatcher_pb2 as dpb
    from dpex.version import versions
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.testing import wait_until

    server = DispatcherServer(DispatcherConfig(host="127.0.0.1", port=0, work_dir=str(tmp_path),
                                               heartbeat_interval_s=0.2))
    store = server.core.store
    gate = threading.Event()
    real = store.journal.sync
    store.journal.sync = lambda: (gate.wait(), real())
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = dgrpc.DispatcherStub(ch)
            registered = stub.RegisterWorker.future(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.1:1"))
            wait_until(lambda: store.appended == 1, what="the registration written")
            assert not registered.done() and store.durable == 0
            gate.set()
            worker = registered.result(timeout=10)
            assert store.durable >= 1
            gate.clear()
            job = stub.GetOrCreateJob.future(dpb.GetOrCreateJobRequest(job=dpb.JobDef(
                name="j", dataset=b"x", num_consumers=1, batch_size=2)))
            wait_until(lambda: store.appended == 2, what="the job written")
            assert not job.done()
            gate.set()
            made = job.result(timeout=10)
            gate.clear()
            sampler = dpb.SamplerSpec(torch_version=samplers.torch_version(), length=16, batch_size=2,
                                      kind=dpb.SamplerSpec.SEQUENTIAL)
            plan = stub.SubmitPlan.future(dpb.SubmitPlanRequest(job_id=made.job_id, job_key=made.job_key, epoch=0,
                                                                sampler=sampler))
            beat = stub.WorkerHeartbeat.future(dpb.WorkerHeartbeatRequest(worker_id=worker.worker_id, want_splits=2,
                                                                          worker_key=worker.worker_key))
            wait_until(lambda: store.appended == 4, what="the plan and the assignment written")
            assert not plan.done() and not beat.done()  # the splits are chosen, but not durably yet
            gate.set()
            assert plan.result(timeout=10).num_batches == 8
            assert len(beat.result(timeout=10).splits) == 2
        assert store.syncs <= 4
    finally:
        gate.set()
        server.close(0)


def test_a_journal_corrupt_in_the_middle_is_refused_at_start_and_kept(tmp_path):
    # One byte flipped at a quarter of the journal: the dispatcher served on with
    # 3 of 76 records and cut the rest from the file (issue 61).
    with test_cluster(num_workers=1, work_dir=str(tmp_path), dispatcher_flags=("--journal-compact-kb", "0")) as c:  # never compacted
        with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40),
                                   batch_size=2, job_name="kept", timeout=60) as dl:
            assert len(list(dl)) == 20
        c.dispatcher.process.kill()  # kill -9: its journal as it was, not compacted into a snapshot at exit
        c.dispatcher.process.wait()
    logs = [f for f in os.listdir(tmp_path) if f.startswith("journal") and f.endswith(".log")]
    (name,) = logs
    path = os.path.join(tmp_path, name)
    data = bytearray(open(path, "rb").read())
    assert len(data) > 500
    data[len(data) // 4] ^= 0x01
    open(path, "wb").write(bytes(data))
    done = subprocess.run([sys.executable, "-m", "dpex.cmd.dispatcher", "--host", "127.0.0.1", "--port", "0",
                           "--work-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "is corrupt" in done.stderr and "good records follow it" in done.stderr, \
        done.stderr[-2000:]
    assert open(path, "rb").read() == bytes(data)  # the evidence kept
