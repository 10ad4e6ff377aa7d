"""The dispatcher's journal on a full disk (a 2 MB tmpfs in a mount
namespace of its own, filled mid-epoch): changes are refused as an outage
(UNAVAILABLE, which trainers and workers ride out), health says NOT_SERVING,
a metric counts it, and once there is room the epoch goes on: every batch
exactly once, and the journal holds what memory held (after a kill -9 the
restarted dispatcher counts the same batches delivered). Before, trainers died
at once with "OSError: [Errno 28]" and the buffered journal wrote refused acks
later (issue 61)."""
import textwrap

import pytest

from dpex.testing import mounts

pytestmark = pytest.mark.skipif(not mounts.available(), reason="needs root and unshare for a mount namespace")

SCRIPT = textwrap.dedent("""
    import os, sys, threading
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    import dpex
    from dpex.proto import dispatcher_pb2 as dpb, dispatcher_pb2_grpc as dgrpc
    from dpex.rpc import call, channel
    from dpex.testing import test_cluster, wait_until
    from dpex.testing.mounts import fill

    work_dir = sys.argv[1]
    SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

    def health(address):
        with grpc.insecure_channel(address) as ch:
            return health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="dpex.v1.Dispatcher"), timeout=5).status

    def status(address):
        return call(dgrpc.DispatcherStub(channel(address)).GetStatus, dpb.GetStatusRequest(), target="d",
                    timeout_s=10)

    with test_cluster(num_workers=1, work_dir=work_dir, dispatcher_flags=("--journal-compact-kb", "0")) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=4000)  # its records fill pages the journal holds
        got, errors = [], []
        with dpex.RemoteDataLoader(c.address, spec, batch_size=2, job_name="full", timeout=120) as dl:
            it = iter(dl)
            got += [next(it)["y"].tolist() for _ in range(10)]

            def read():
                try:
                    for batch in it:
                        got.append(batch["y"].tolist())
                except BaseException as e:
                    errors.append(e)
            filler = fill(work_dir)
            reader = threading.Thread(target=read)  # its acks and the worker's new splits: writes that fail
            reader.start()
            wait_until(lambda: health(c.address) == NOT_SERVING, 60, "health NOT_SERVING")
            during = status(c.address)
            os.unlink(filler)
            reader.join(120)
            assert not errors and not reader.is_alive(), errors
            wait_until(lambda: health(c.address) == SERVING, 30, "health SERVING again")
        assert sorted(y for b in got for y in b) == list(range(4000)), "not every sample exactly once"
        c.restart_dispatcher()  # kill -9, then from the journal
        job = next(j for j in status(c.address).jobs if j.name == "full")
        print("failing", during.journal_failing, "errors", during.journal_write_errors_total > 0,
              "delivered", job.batches_delivered, "of", job.batches_planned, flush=True)
""")


def test_a_full_disk_under_the_journal_is_an_outage_ridden_out_exactly_once(tmp_path):
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    done = mounts.run_with_tmpfs(SCRIPT, str(work_dir), "2m", str(work_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "failing True errors True delivered 2000 of 2000", done.stdout


PLAN_SCRIPT = textwrap.dedent("""
    import os, sys, threading
    import dpex
    from dpex.testing import test_cluster, wait_until
    from dpex.testing.mounts import fill

    work_dir = sys.argv[1]
    with test_cluster(num_workers=1, work_dir=work_dir) as c:
        filler = fill(work_dir)
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=64)
        order = list(range(63, -1, -1))  # a sampler Dpex cannot describe: its plan is uploaded as batches, to a file
        got, errors = [], []

        def train():
            try:
                with dpex.RemoteDataLoader(c.address, spec, batch_size=4, sampler=order, timeout=120) as dl:
                    got.extend(y for b in dl for y in b["y"].tolist())
            except BaseException as e:
                errors.append(e)
        trainer = threading.Thread(target=train)
        trainer.start()
        log = open(os.path.join(c.log_dir, "dispatcher-1.log")).read
        wait_until(lambda: "cannot write its plan files" in log() or not trainer.is_alive(), 60, "the refusal")
        os.unlink(filler)
        trainer.join(120)
        print("errors", errors, "in order", got == order, flush=True)
""")


def test_a_plan_uploaded_to_a_full_disk_is_an_outage_ridden_out(tmp_path):
    """The chaos campaign's find: a plan of explicit batches (an elastic reshard,
    a sampler Dpex cannot describe) is written to files beside the journal; on a
    full disk that write raised OSError to the trainer ("No space left on
    device"), which died. It is now refused as the journal's writes are."""
    work_dir = tmp_path / "work"
    work_dir.mkdir()
    done = mounts.run_with_tmpfs(PLAN_SCRIPT, str(work_dir), "2m", str(work_dir))
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "errors [] in order True", done.stdout + done.stderr[-3000:]
