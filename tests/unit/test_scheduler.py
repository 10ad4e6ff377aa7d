"""The worker's scheduler on a pool run by hand (tests.unit.batches.ManualPool):
which batches it starts and when, that memory stays bounded by the buffer,
that requested batches still get made, that released work is dropped.
A batch is made only when the test says: no process, nothing timed.
(The scheduler over the real process pool: tests/unit/test_runners.py.)"""
import time

import pytest

from dpex.proto import dispatcher_pb2 as dpb
from dpex.testing import wait_until
from dpex.wire import decode, parse_frame
from dpex.wire.batchkey import EpochKey, Key
from dpex.worker.scheduler import Scheduler
from tests.unit.batches import ManualPool, job_file

BUFFER = 3


@pytest.fixture
def pool():
    return ManualPool()


def make(pool, tmp_path, **kw):
    path = job_file(tmp_path, "Squares", n=100)
    kw = dict(dict(buffer_batches=BUFFER, max_inflight=2, worker_address="test-worker", unknown_grace_s=0.3), **kw)
    return Scheduler(pool, lambda job_id: path, **kw)


@pytest.fixture
def scheduler(pool, tmp_path):
    s = make(pool, tmp_path)
    yield s
    s.close()


def split(split_id=1, first=0, n=20, job_id=9):
    return dpb.Split(split_id=split_id, job_id=job_id, consumer_index=0, epoch=0, first_seq=first,
                     batches=[dpb.IndexBatch(indices=[2 * i, 2 * i + 1]) for i in range(first, first + n)])


def held(s, job_id=9):
    """(batches, bytes) the job's consumer 0 holds ready."""
    return s.holdings().get((job_id, 0), (0, 0))


def key(seq, job_id=9):
    return Key(epoch=0, seq=seq, consumer_index=0, job_id=job_id)


def seqs(frames):
    return [parse_frame(f)[0].seq for f in frames]


def drive(pool, until, what):
    """Makes every batch the scheduler starts, as it starts them, until ``until()``."""
    while True:
        wait_until(lambda: until() or pool.running(), what=what)
        if until():
            return
        pool.finish()


def test_buffer_bounds_what_is_produced_ahead(scheduler, pool):
    scheduler.add_split(split())
    assert pool.wait_running(2) == [0, 1]  # max_inflight at a time
    pool.finish()
    assert pool.wait_running(1) == [2]  # two ready, the buffer's third
    pool.finish()
    assert scheduler.depth() == (BUFFER, 0) and pool.started == [0, 1, 2]  # and no more is started
    # The split still has batches to produce, but its consumer holds its whole
    # share: the worker takes other splits rather than wait for it.
    assert scheduler.free_capacity(4) == (4, [(9, 0)])  # and none of its splits
    got = []
    made_at = scheduler._held.find(key(0)).made_at[key(0)]
    scheduler.request(key(0), got.append)
    assert seqs(got) == [0]  # from the buffer, at once
    assert 0 < scheduler.meter.queued_s <= time.monotonic() - made_at  # how long it waited, made, for the request
    assert scheduler.free_capacity(4) == (3, [])  # room again: its split counts
    assert pool.wait_running(1) == [3]


def test_a_consumers_epoch_is_one_lane_of_the_pool(scheduler, pool):
    scheduler.add_split(split(n=4))
    drive(pool, lambda: len(pool.started) == 3, "the buffer made")
    assert pool.lanes == [EpochKey(9, 0, 0)] * 3  # its batches cycle through the processes, as torch's


def test_requested_batches_are_produced_beyond_the_buffer(scheduler, pool):
    scheduler.add_split(split())
    drive(pool, lambda: scheduler.depth() == (BUFFER, 0), "a full buffer")
    got = []
    scheduler.request(key(15), got.append)
    assert pool.wait_running(1) == [15]  # asked for: made beyond the buffer
    pool.finish(15)
    meta, payload = parse_frame(got[0])
    assert meta.seq == 15 and decode(payload)["y"].tolist() == [30, 31]
    assert scheduler.depth() == (BUFFER, 0)
    scheduler.request(key(0), got.append)  # from the buffer at once
    assert seqs(got) == [15, 0]
    assert pool.wait_running(1) == [3]  # the buffer refills


def test_released_and_unknown_batches_answer_not_assigned(scheduler, pool):
    got = []
    scheduler.request(key(50), got.append)  # no split holds it yet
    scheduler.add_split(split(split_id=2, first=40, n=2))
    scheduler.request(key(41), got.append)
    assert pool.wait_running(2) == [40, 41]
    pool.finish(41)
    assert 41 in seqs(got)  # (the unknown batch's time-out may have come first)
    scheduler.release([2])
    wait_until(lambda: len(got) == 2, what="the unknown batch to time out")
    answers = {parse_frame(f)[0].seq: parse_frame(f)[0] for f in got}
    assert answers[50].not_assigned and not answers[41].not_assigned
    pool.finish(40)  # made after its split was released: dropped
    assert len(got) == 2 and scheduler.depth() == (0, 0)
    scheduler.request(key(40), got.append)  # released: no longer ours
    wait_until(lambda: len(got) == 3, what="a not_assigned answer")
    assert parse_frame(got[2])[0].not_assigned
    assert scheduler.held_split_ids() == [] and sorted(pool.started) == [40, 41]


def test_cancelled_stream_requests_are_forgotten(scheduler, pool):
    got = []
    scheduler.request(key(3), got.append)
    scheduler.cancel(got.append)
    scheduler.add_split(split(split_id=3, first=0, n=4))
    drive(pool, lambda: scheduler.depth()[0] == BUFFER, "production")
    assert pool.started == [0, 1, 2] and got == []  # batch 3 was not made first, nor sent


def test_a_taken_over_split_produces_only_what_was_not_delivered(scheduler, pool):
    # A split taken from a lost worker: the trainer acknowledged seqs 0-2 already.
    taken = split()
    taken.delivered_seqs[:] = [0, 1, 2]
    scheduler.add_split(taken)
    drive(pool, lambda: scheduler.depth() == (BUFFER, 0), "a full buffer")
    assert pool.started == [3, 4, 5]  # produced ahead: delivered ones skipped
    got = []
    for seq in (3, 4, 5):
        scheduler.request(key(seq), got.append)
    assert seqs(got) == [3, 4, 5]
    scheduler.request(key(1), got.append)  # a trainer resuming from a checkpoint may still ask
    wait_until(lambda: 1 in pool.running(), what="delivered batch 1 asked again, made")
    pool.finish(1)
    meta, payload = parse_frame(got[3])
    assert meta.seq == 1 and decode(payload)["y"].tolist() == [2, 3]


def test_a_newcomer_gets_its_share_of_memory_another_consumer_filled(pool, tmp_path):
    # Job 9's consumer was alone and filled the worker's memory for batches
    # made ahead, then stopped asking (paused). Job 10 arrives: the memory is
    # split, job 9's batches over its share are evicted (made again if it
    # asks), job 10 produces ahead.
    s = make(pool, tmp_path, buffer_batches=4)
    try:  # each consumer has its own depth: both hold 4 while memory suffices
        s.add_split(split(split_id=1, job_id=9))
        s.add_split(split(split_id=2, job_id=10))
        drive(pool, lambda: held(s, 9)[0] == 4 and held(s, 10)[0] == 4, "two full depths")
        size = held(s, 9)[1] // 4
    finally:
        s.close()
    pool = ManualPool()
    s = make(pool, tmp_path, buffer_batches=4, buffer_bytes=4 * size + size // 2)  # memory for 4 such batches
    try:
        s.add_split(split(split_id=1, job_id=9))
        drive(pool, lambda: held(s, 9)[0] == 4, "job 9 filling the memory")
        s.add_split(split(split_id=2, job_id=10))
        # Its first batches, of a size not known yet, go over the bound for a moment; job 9's newest are evicted.
        drive(pool, lambda: held(s, 10)[0] == 2 and held(s, 9)[0] == 2, "job 10's share, job 9's evicted")
        assert s.depth() == (4, 0)
        got = []
        s.request(key(3, job_id=9), got.append)  # an evicted batch, asked for: made again
        wait_until(lambda: 3 in pool.running(job_id=9), what="evicted batch 3 made again")
        pool.finish(3, job_id=9)
        meta, payload = parse_frame(got[0])
        assert meta.seq == 3 and decode(payload)["y"].tolist() == [6, 7]
        assert pool.started.count(3) == 2  # job 9's batch 3, twice (job 10's is not there yet)
    finally:
        s.close()


def test_a_consumer_whose_streams_closed_holds_nothing(scheduler, pool):
    got = []
    scheduler.request(key(0), got.append)  # its stream asks for batch 0
    scheduler.add_split(split())
    drive(pool, lambda: got and scheduler.depth() == (BUFFER, 0), "a full buffer")
    scheduler.cancel(got.append)  # the stream closed: the trainer left
    assert scheduler.depth()[0] == 0 and held(scheduler, 9) == (0, 0)
    assert scheduler.free_capacity(4) == (4, [(9, 0)])  # an idle consumer's split keeps nothing out
    assert pool.running() == []  # and nothing is made ahead for it meanwhile
    scheduler.request(key(5), got.append)   # it came back: produced on request, then ahead again
    drive(pool, lambda: len(got) == 2 and scheduler.depth()[0] == BUFFER, "production again")
    assert seqs(got) == [0, 5] and pool.started[4] == 5  # the asked-for batch first


@pytest.fixture
def wide(pool, tmp_path, request):
    """A scheduler that may run 8 batches at once (a buffer of 2 batches, or
    the test's indirect parameter)."""
    s = make(pool, tmp_path, buffer_batches=getattr(request, "param", 2), max_inflight=8)
    yield s
    s.close()


def test_a_requested_batch_leaves_the_read_ahead_so_one_consumer_keeps_the_processes_busy(wide, pool):
    s = wide
    s.add_split(split(n=20))
    assert pool.wait_running(2) == [0, 1] and s.depth() == (0, 2)  # the read-ahead running
    assert s.free_capacity(4)[1] == [(9, 0)]  # its read-ahead is full: saturated
    freed, got = [], []
    s.on_capacity = lambda: freed.append(1)
    s.request(key(0), got.append)  # both already running ahead: asked for now, they
    s.request(key(1), got.append)  # count in the trainer's window, not the read-ahead
    assert not freed  # the room goes to the split's next batches: no new split needed yet
    assert pool.wait_running(4) == [0, 1, 2, 3]  # two more started ahead
    pool.finish()
    assert sorted(seqs(got)) == [0, 1] and s.depth() == (2, 0)  # the requested sent, the read-ahead ready


# A buffer the consumer cannot fill (8 batches in all): it is never saturated,
# however many of its batches the scheduler's thread has started ahead by the
# time of each question.
@pytest.mark.parametrize("wide", [16], indirect=True)
def test_a_worker_takes_more_small_splits_while_its_pool_would_idle(wide):
    s = wide
    s.add_split(split(split_id=1, first=0, n=1))
    s.add_split(split(split_id=2, first=1, n=1))
    assert s.free_capacity(2) == (1, [])  # two splits held, two batches left for a pool that runs 8
    s.add_split(split(split_id=3, first=2, n=6))
    assert s.free_capacity(2) == (0, [])  # eight batches left: enough


def test_a_saturated_consumer_with_nothing_left_to_make_lets_the_worker_take_its_splits(wide, pool):
    s = wide
    s.add_split(split(n=2))
    assert pool.wait_running(2) == [0, 1] and s.depth() == (0, 2)  # the read-ahead running
    assert s.free_capacity(4)[1] == [(9, 0)]  # saturated, as reported
    freed = []
    s.on_capacity = lambda: freed.append(1)
    s.request(key(0), lambda frame: None)
    assert freed  # room, and nothing of it left here: the worker asks for its splits at once


def test_a_failed_batch_is_its_error_frame_and_the_split_goes_on(scheduler, pool):
    got = []
    scheduler.add_split(split(n=4))
    scheduler.request(key(0), got.append)
    assert pool.wait_running(2) == [0, 1]
    pool.finish(0, error=ValueError("bad sample"))  # a batch process's exception, as the pool raises it
    meta = parse_frame(got[0])[0]
    assert meta.seq == 0 and "bad sample" in meta.error.message
    drive(pool, lambda: scheduler.depth()[0] == BUFFER, "the rest made ahead")
    assert pool.started == [0, 1, 2, 3]


def test_a_split_replaced_while_its_batches_are_made_has_them_made_again_for_its_successor(pool, tmp_path):
    """An epoch begun again (its plan replaced: new splits of the same batch keys) while the old split's
    batches were in the pool: those keys were taken for being made, dropped from the new split's queue,
    and asked for in vain once the old ones finished, released (issue 58's "stall after 8 batches")."""
    scheduler = make(pool, tmp_path, max_inflight=4)
    try:
        scheduler.add_split(split(split_id=1, n=4))
        assert pool.wait_running(3) == [0, 1, 2]  # the buffer's worth
        scheduler.release([1])
        scheduler.add_split(split(split_id=2, n=4))  # the same keys, another split
        got = []
        for seq in (0, 1, 2):
            scheduler.request(key(seq), got.append)
        pool.finish(0, 1, 2)  # the old split's: dropped
        drive(pool, lambda: len(got) == 3, "batches 0-2 of the new split")
        assert sorted(seqs(got)) == [0, 1, 2] and not any(parse_frame(f)[0].not_assigned for f in got)
    finally:
        scheduler.close()


def test_a_successor_that_came_before_the_old_splits_release_keeps_its_batches(scheduler, pool):
    """The new plan's split (the same keys) reached the worker before the old one's release: releasing the
    old one dropped the successor's keys from the index and the queue (issue 58)."""
    scheduler.add_split(split(split_id=1, n=4))
    scheduler.add_split(split(split_id=2, n=4))
    scheduler.release([1])
    got = []
    for seq in range(4):
        scheduler.request(key(seq), got.append)
    drive(pool, lambda: len(got) == 4, "the successor's four batches")
    assert sorted(seqs(got)) == [0, 1, 2, 3] and not any(parse_frame(f)[0].not_assigned for f in got)
    assert scheduler.held_split_ids() == [2]
