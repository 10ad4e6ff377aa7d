"""Garbage collection on a real dispatcher: an abandoned job is removed while
another job keeps running on the same workers; a gone worker is forgotten; a
trainer that comes back gets a fresh job, not a hang."""
import signal

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import channel
from dpex.testing import test_cluster, wait_until

GC = ("--job-gc-timeout", "2", "--worker-gc-timeout", "2")


def status(address):
    with channel(address) as ch:
        return dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=5)


def test_an_abandoned_job_is_collected_while_another_keeps_running():
    with test_cluster(num_workers=2, dispatcher_flags=GC) as c:
        abandoned = dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40),
                                          batch_size=4, job_name="abandoned", timeout=30)
        it = iter(abandoned)
        first = [next(it)["y"].tolist() for _ in range(2)]  # then left mid-epoch, never closed
        old_job = abandoned.job_id
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=400, delay_s=0.002)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, timeout=30) as busy:
            got = []
            for batch in busy:  # a job that keeps working while the other is collected
                got += batch["y"].tolist()
                if len(got) == 8:
                    del it
                    wait_until(lambda: old_job not in {j.job_id for j in status(c.address).jobs}, 30,
                               "the abandoned job to be collected")
            assert got == list(range(400))
        s = status(c.address)
        assert s.jobs_collected_total == 1 and busy.job_id in {j.job_id for j in s.jobs}
        out = c.dispatcher.log_tail(200)
        assert "removing a job without consumers" in out
        # The trainer comes back: a fresh job of the same definition, a whole epoch.
        assert [b["y"].tolist() for b in abandoned][:2] == first
        assert abandoned.job_id != old_job and len(list(abandoned)) == 10
        abandoned.close()


def test_a_gone_worker_is_forgotten_and_status_says_so():
    with test_cluster(num_workers=2, dispatcher_flags=GC) as c:
        gone = c.kill_worker(0, signal.SIGKILL)
        wait_until(lambda: status(c.address).workers_forgotten_total == 1, 30, "the worker to be forgotten")
        assert gone.address not in {w.address for w in status(c.address).workers}
        from dpex.cmd.status import render
        assert "collected: 0 jobs, 1 workers" in render(status(c.address))


def test_a_collected_epoch_is_ended_by_the_reaper_not_in_the_collecting_thread(monkeypatch):
    """Found by the differential tester (issue 55): the garbage collector ran a dropped epoch's finalizer
    inside gRPC, in a thread holding a channel's lock, and ending the epoch there (gRPC calls on that
    channel) deadlocked. A collected epoch is now ended by a thread of its own, the dispatcher told."""
    import gc
    import threading

    from dpex.client import fetcher
    ended_in = []
    real = fetcher._Exit.__call__

    def spy(self):
        if not self._done:
            ended_in.append(threading.current_thread().name)
        real(self)
    monkeypatch.setattr(fetcher._Exit, "__call__", spy)
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40),
                                   batch_size=4, timeout=30) as loader:
            pairs = list(zip(loader, loader))  # the second epoch is left with a batch unread
            assert len(pairs) == 10
            gc.collect()
            wait_until(lambda: len(ended_in) >= 2, 30, "both epochs to end")
            assert "dpex-reaper" in ended_in and all(name in ("dpex-reaper", "MainThread") for name in ended_in)
            assert len(list(loader)) == 10  # the loader goes on
