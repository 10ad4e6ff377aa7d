"""Jobs sharing a worker are isolated: a paused consumer holds only its share
of what the worker keeps ready, and an epoch its trainer left (iterator
dropped, close(), trainer killed) is forgotten at once on the
worker: its batches leave memory and /dev/shm. Both data paths."""
import subprocess
import sys
import textwrap

import pytest

import dpex
from dpex.testing import test_cluster, wait_until
from tests.integration.test_observability import scrape, total

BUFFER = 8
SPEC = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=400)


@pytest.fixture(scope="module")
def one_worker():
    # A consumer timeout far beyond the waits below: what they see is the
    # worker and dispatcher reacting to the trainer, not the reaper.
    with test_cluster(num_workers=1, processes=1, buffer_batches=BUFFER, metrics=True,
                      consumer_timeout_s=120.0) as c:
        yield c


def ready(cluster, loader) -> float:
    """Batches the worker holds ready for ``loader``'s consumer."""
    return total(scrape(cluster.workers[0].metrics_url), "dpex_worker_consumer_ready_batches",
                 job_id=loader.job_id, consumer=0)


def left_nothing(cluster, loader) -> bool:
    m = scrape(cluster.workers[0].metrics_url)
    return (total(m, "dpex_worker_consumer_ready_batches", job_id=loader.job_id) == 0
            and total(m, "dpex_worker_shm_bytes", kind="frame") == 0)


def paused_beside_busy(c, shm, spec, name, shared):
    """A pauses with an epoch open; B runs a whole epoch beside it; A then
    resumes. ``shared(a, b)`` is the condition the worker reaches with both."""
    with dpex.RemoteDataLoader(c.address, spec, batch_size=4, job_name=f"paused-{name}", window=2,
                               shared_memory=shm, timeout=60) as a, \
            dpex.RemoteDataLoader(c.address, spec, batch_size=4, job_name=f"busy-{name}", window=2,
                                  shared_memory=shm, timeout=60) as b:
        paused = iter(a)
        next(paused)  # then the trainer does something else for a long while
        wait_until(lambda: ready(c, a) >= 6, what="A, alone, filling what it may hold")
        epoch = iter(b)
        first = next(epoch)["y"].tolist()
        wait_until(lambda: shared(a, b), what="B getting its share beside A")
        rest = [y for batch in epoch for y in batch["y"].tolist()]
        assert first + rest == list(range(400))
        got = [y for batch in paused for y in batch["y"].tolist()]  # A resumes: nothing lost
        assert got == list(range(4, 400))


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "grpc"])
def test_a_paused_consumer_takes_nothing_of_another_jobs_buffer(one_worker, shm):
    c = one_worker  # each consumer has its own depth of BUFFER batches: A's do not count against B
    paused_beside_busy(c, shm, SPEC, f"depth-{shm}",
                       lambda a, b: ready(c, a) == BUFFER and ready(c, b) == BUFFER)


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "grpc"])
def test_a_paused_consumer_holds_only_its_share_of_memory(shm):
    # 128 KiB batches, 1 MiB for batches made ahead: A alone takes 7; beside
    # B each may hold about half, and A's surplus is evicted as B needs it.
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=400, dim=8192)
    with test_cluster(num_workers=1, processes=1, metrics=True, consumer_timeout_s=120.0,
                      worker_flags=("--shm-min-kb", "0", "--buffer-mb", "1")) as c:
        def shared(a, b):
            m = scrape(c.workers[0].metrics_url)
            a_bytes = total(m, "dpex_worker_consumer_ready_bytes", job_id=a.job_id)
            return a_bytes <= 2**19 + 2**17 + 1024 and ready(c, b) >= 3  # half, give or take a batch
        paused_beside_busy(c, shm, spec, f"memory-{shm}", shared)


@pytest.mark.parametrize("shm", [True, False], ids=["same-host", "grpc"])
@pytest.mark.parametrize("how", ["break", "next-iter", "new-iter", "close"])
def test_a_left_epoch_is_forgotten_at_once(one_worker, shm, how):
    c = one_worker
    loader = dpex.RemoteDataLoader(c.address, SPEC, batch_size=4, job_name=f"left-{how}-{shm}",
                                   shared_memory=shm, timeout=60)
    try:
        if how == "break":
            for i, _ in enumerate(loader):
                if i == 2:
                    wait_until(lambda: ready(c, loader) > 0, what="batches made ahead")
                    break
        elif how == "next-iter":
            next(iter(loader))
        else:
            epoch = iter(loader)
            next(epoch)
            wait_until(lambda: ready(c, loader) > 0, what="batches made ahead")
            if how == "new-iter":  # an epoch of its own, as torch's; the first goes on until it is dropped
                assert next(iter(loader))["y"].tolist() == [0, 1, 2, 3]  # a new epoch starts afresh
                assert next(epoch)["y"].tolist() == [4, 5, 6, 7]
                del epoch
            else:
                loader.close()
        wait_until(lambda: left_nothing(c, loader), 10, "the left epoch's batches to be freed")
        job = wait_until(lambda: [j for j in dpex_status(c) if j.job_id == loader.job_id], 10, "the job")[0]
        assert job.splits_assigned + job.splits_unassigned == 0  # nothing of it is planned any more
    finally:
        loader.close()


def test_a_killed_trainers_batches_are_freed_at_once(one_worker):
    c = one_worker
    script = textwrap.dedent(f"""
        import os, signal, dpex
        loader = dpex.RemoteDataLoader({c.address!r}, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=400),
                                       batch_size=4, job_name="killed", timeout=60)
        it = iter(loader)
        next(it)
        print(loader.job_id, flush=True)
        input()  # the test kills us while we hold the epoch
    """)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        job_id = int(trainer.stdout.readline())
        held = lambda: total(scrape(c.workers[0].metrics_url), "dpex_worker_consumer_ready_batches",  # noqa: E731
                             job_id=job_id)
        wait_until(lambda: held() > 0, what="batches made ahead for the trainer")
        trainer.kill()
        trainer.wait()
        wait_until(lambda: held() == 0, 10, "the killed trainer's batches to be freed")
        assert total(scrape(c.workers[0].metrics_url), "dpex_worker_shm_bytes", kind="frame") == 0
    finally:
        trainer.kill()
        trainer.wait()


def dpex_status(cluster):
    from dpex.proto import dispatcher_pb2 as dpb
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.rpc import channel
    ch = channel(cluster.address)
    try:
        return dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10).jobs
    finally:
        ch.close()


def test_a_jobs_whole_permutation_draw_does_not_hold_up_another_job():
    # A shuffled epoch of 3 * 10^8 samples: the worker draws torch's permutation of all
    # of them (about 20 s here) before its first batch. Another job's epoch runs meanwhile,
    # and the drawing job holds one split's room, not the worker's every split.
    big = dpex.DatasetSpec("dpex.client.sampling:Indices", 3 * 10**8)
    with test_cluster(num_workers=1, processes=1, buffer_batches=BUFFER, metrics=True) as c, \
            dpex.RemoteDataLoader(c.address, big, batch_size=1024, shuffle=True, timeout=120) as slow, \
            dpex.RemoteDataLoader(c.address, SPEC, batch_size=4, shuffle=True, seed=2, timeout=10) as quick:
        drawing = iter(slow)
        wait_until(lambda: total(scrape(c.workers[0].metrics_url), "dpex_worker_splits_held") > 0,
                   what="the worker to take the big epoch's first split")
        epoch = iter(quick)
        got = next(epoch)["y"].tolist()  # then the trainer pauses: the worker makes its batches ahead
        wait_until(lambda: ready(c, quick) >= BUFFER // 2, 10, "the other job's batches made ahead beside the draw")
        got += [y for batch in epoch for y in batch["y"].tolist()]
        assert sorted(got) == list(range(400))
        drawing.close()
