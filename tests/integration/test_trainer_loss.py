"""A trainer that disappears mid-epoch is released after --consumer-timeout,
and the workers free what they held for it."""
import signal
import subprocess
import sys
import textwrap

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import channel
from dpex.testing import test_cluster, wait_until

TRAINER = textwrap.dedent("""
    import sys, dpex
    dl = dpex.RemoteDataLoader(sys.argv[1], dpex.DatasetSpec("dpex.testing.datasets:Slow", n=4000, delay_s=0.002),
                               batch_size=4, job_name="orphan")
    for i, _ in enumerate(dl):
        if i == 5:
            print("iterating", flush=True)
""")


def status(address):
    with channel(address) as ch:
        return dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10)


def test_a_vanished_trainer_is_released_and_workers_free_its_splits():
    with test_cluster(num_workers=2, consumer_timeout_s=3.0) as c:
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, c.address], stdout=subprocess.PIPE, text=True)
        assert trainer.stdout.readline().strip() == "iterating"
        job = next(j for j in status(c.address).jobs if j.name == "orphan")
        assert job.splits_assigned > 0
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()

        def released():
            s = status(c.address)
            j = next(j for j in s.jobs if j.name == "orphan")
            return j.splits_assigned == 0 and j.splits_unassigned == 0 and all(w.splits_held == 0 for w in s.workers)
        wait_until(released, 30, "the orphaned plan to be released")
        # The cluster still serves a new trainer.
        with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=8),
                                   batch_size=4, timeout=30) as dl:
            assert [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]
