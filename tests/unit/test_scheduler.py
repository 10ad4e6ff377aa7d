"""The worker's scheduler, with a real process pool: memory stays bounded by
the buffer, requested batches still get produced, released work is dropped."""
import pytest

from dpex.proto import dispatcher_pb2 as dpb
from dpex.testing import wait_until
from dpex.wire import decode, parse_frame
from dpex.worker.pool import BatchPool
from dpex.wire.batchkey import Key
from dpex.worker.scheduler import Scheduler
from tests.unit.batches import job_file

BUFFER = 3


@pytest.fixture
def scheduler(pool, tmp_path):
    path = job_file(tmp_path, "Squares", n=100)
    s = Scheduler(pool, lambda job_id: path, buffer_batches=BUFFER, max_inflight=2,
                  worker_address="test-worker", unknown_grace_s=0.3)
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


def test_buffer_bounds_what_is_produced_ahead(scheduler):
    scheduler.add_split(split())
    wait_until(lambda: scheduler.depth() == (BUFFER, 0), what="a full buffer")
    assert scheduler.depth() == (BUFFER, 0)  # and no more is started
    # The split still has batches to produce, but its consumer holds its whole
    # share: the worker takes other splits rather than wait for it.
    assert scheduler.free_capacity(4) == (4, [(9, 0)])  # and none of its splits
    got = []
    scheduler.request(key(0), got.append)
    assert scheduler.free_capacity(4) == (3, [])  # room again: its split counts


def test_requested_batches_are_produced_beyond_the_buffer(scheduler):
    scheduler.add_split(split())
    wait_until(lambda: scheduler.depth() == (BUFFER, 0), what="a full buffer")
    got = []
    scheduler.request(key(15), got.append)
    wait_until(lambda: got, what="batch 15")
    meta, payload = parse_frame(got[0])
    assert meta.seq == 15 and decode(payload)["y"].tolist() == [30, 31]
    assert scheduler.depth() == (BUFFER, 0)
    scheduler.request(key(0), got.append)  # from the buffer at once
    assert parse_frame(got[1])[0].seq == 0
    wait_until(lambda: scheduler.depth() == (BUFFER, 0), what="the buffer to refill")


def test_released_and_unknown_batches_answer_not_assigned(scheduler):
    got = []
    scheduler.request(key(50), got.append)  # no split holds it yet
    scheduler.add_split(split(split_id=2, first=40, n=2))
    scheduler.request(key(41), got.append)
    # Batch 41 and the unknown batch's time-out come in either order (a loaded machine makes batches slowly)
    wait_until(lambda: any(parse_frame(f)[0].seq == 41 for f in got), what="batch 41")
    scheduler.release([2])
    wait_until(lambda: len(got) == 2, what="the unknown batch to time out")
    answers = {parse_frame(f)[0].seq: parse_frame(f)[0] for f in got}
    assert answers[50].not_assigned and not answers[41].not_assigned
    scheduler.request(key(40), got.append)  # released: no longer ours
    wait_until(lambda: len(got) == 3, what="a not_assigned answer")
    assert parse_frame(got[2])[0].not_assigned
    assert scheduler.held_split_ids() == []


def test_cancelled_stream_requests_are_forgotten(scheduler):
    got = []
    scheduler.request(key(3), got.append)
    scheduler.cancel(got.append)
    scheduler.add_split(split(split_id=3, first=0, n=4))
    wait_until(lambda: scheduler.depth()[0] == BUFFER, what="production")
    assert got == []


def test_a_taken_over_split_produces_only_what_was_not_delivered(scheduler):
    # A split taken from a lost worker: the trainer acknowledged seqs 0-2 already.
    taken = split()
    taken.delivered_seqs[:] = [0, 1, 2]
    scheduler.add_split(taken)
    wait_until(lambda: scheduler.depth() == (BUFFER, 0), what="a full buffer")
    got = []
    for seq in (3, 4, 5):
        scheduler.request(key(seq), got.append)
    assert [parse_frame(f)[0].seq for f in got] == [3, 4, 5]  # produced ahead: delivered ones skipped
    scheduler.request(key(1), got.append)  # a trainer resuming from a checkpoint may still ask
    wait_until(lambda: len(got) == 4, what="delivered batch 1 asked again")
    meta, payload = parse_frame(got[3])
    assert meta.seq == 1 and decode(payload)["y"].tolist() == [2, 3]


def test_a_newcomer_gets_its_share_of_memory_another_consumer_filled(pool, tmp_path):
    # Job 9's consumer was alone and filled the worker's memory for batches
    # made ahead, then stopped asking (paused). Job 10 arrives: the memory is
    # split, job 9's batches over its share are evicted (made again if it
    # asks), job 10 produces ahead.
    path = job_file(tmp_path, "Squares", n=100)

    def scheduler(buffer_bytes):
        return Scheduler(pool, lambda job_id: path, buffer_batches=4, max_inflight=2, worker_address="w",
                         buffer_bytes=buffer_bytes)
    s = scheduler(1 << 30)
    try:  # each consumer has its own depth: both hold 4 while memory suffices
        s.add_split(split(split_id=1, job_id=9))
        s.add_split(split(split_id=2, job_id=10))
        wait_until(lambda: held(s, 9)[0] == 4 and held(s, 10)[0] == 4, what="two full depths")
        size = held(s, 9)[1] // 4
    finally:
        s.close()
    s = scheduler(4 * size + size // 2)  # memory for 4 such batches
    try:
        s.add_split(split(split_id=1, job_id=9))
        wait_until(lambda: held(s, 9)[0] == 4, what="job 9 filling the memory")
        s.add_split(split(split_id=2, job_id=10))
        wait_until(lambda: held(s, 10)[0] == 2, what="job 10's share")
        assert held(s, 9)[0] == 2 and s.depth() == (4, 0)
        got = []
        s.request(key(3, job_id=9), got.append)  # an evicted batch, asked for: made again
        wait_until(lambda: got, what="evicted batch 3")
        meta, payload = parse_frame(got[0])
        assert meta.seq == 3 and decode(payload)["y"].tolist() == [6, 7]
    finally:
        s.close()


def test_a_consumer_whose_streams_closed_holds_nothing(scheduler):
    got = []
    scheduler.request(key(0), got.append)  # its stream asks for batch 0
    scheduler.add_split(split())
    wait_until(lambda: got and scheduler.depth() == (BUFFER, 0), what="a full buffer")
    scheduler.cancel(got.append)  # the stream closed: the trainer left
    assert scheduler.depth()[0] == 0 and held(scheduler, 9) == (0, 0)
    assert scheduler.free_capacity(4) == (4, [(9, 0)])  # an idle consumer's split keeps nothing out
    scheduler.request(key(5), got.append)   # it came back: produced on request, then ahead again
    wait_until(lambda: len(got) == 2 and scheduler.depth()[0] == BUFFER, what="production again")
    assert parse_frame(got[1])[0].seq == 5


@pytest.fixture
def gated(tmp_path, request):
    """A scheduler over 4 processes whose batches run until ``gate`` exists
    (a buffer of 2 batches, or the test's indirect parameter)."""
    gate = tmp_path / "gate"
    path = job_file(tmp_path, "Gated", n=100, path=str(gate))
    pool4 = BatchPool(4, "test-worker")
    s = Scheduler(pool4, lambda job_id: path, buffer_batches=getattr(request, "param", 2), max_inflight=8,
                  worker_address="w")
    yield s, gate
    gate.touch()
    wait_until(lambda: s.depth()[1] == 0, what="the running batches to finish")
    s.close()
    pool4.close()


def test_a_requested_batch_leaves_the_read_ahead_so_one_consumer_keeps_the_processes_busy(gated):
    s, gate = gated
    s.add_split(split(n=20))
    wait_until(lambda: s.depth() == (0, 2), what="the read-ahead running")
    assert s.free_capacity(4)[1] == [(9, 0)]  # its read-ahead is full: saturated
    freed, got = [], []
    s.on_capacity = lambda: freed.append(1)
    s.request(key(0), got.append)  # both already running ahead: asked for now, they
    s.request(key(1), got.append)  # count in the trainer's window, not the read-ahead
    assert not freed  # the room goes to the split's next batches: no new split needed yet
    wait_until(lambda: s.depth() == (0, 4), what="two more started ahead")
    gate.touch()
    wait_until(lambda: len(got) == 2 and s.depth() == (2, 0), what="the requested sent, the read-ahead ready")
    assert sorted(parse_frame(f)[0].seq for f in got) == [0, 1]  # as they finish: the trainer orders


# A buffer the consumer cannot fill (8 batches in all): it is never saturated,
# however many of its batches the scheduler's thread has started ahead by the
# time of each question (with a buffer of 2 it could be, on a loaded machine).
@pytest.mark.parametrize("gated", [16], indirect=True)
def test_a_worker_takes_more_small_splits_while_its_pool_would_idle(gated):
    s, gate = gated
    s.add_split(split(split_id=1, first=0, n=1))
    s.add_split(split(split_id=2, first=1, n=1))
    assert s.free_capacity(2) == (1, [])  # two splits held, two batches left for a pool that runs 8
    s.add_split(split(split_id=3, first=2, n=6))
    assert s.free_capacity(2) == (0, [])  # eight batches left: enough


def test_a_saturated_consumer_with_nothing_left_to_make_lets_the_worker_take_its_splits(gated):
    s, gate = gated
    s.add_split(split(n=2))
    wait_until(lambda: s.depth() == (0, 2), what="the read-ahead running")
    assert s.free_capacity(4)[1] == [(9, 0)]  # saturated, as reported
    freed = []
    s.on_capacity = lambda: freed.append(1)
    s.request(key(0), lambda frame: None)
    assert freed  # room, and nothing of it left here: the worker asks for its splits at once
