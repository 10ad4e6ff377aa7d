"""The loader's Fetch streams (dpex.client.streams) against the real Worker
service on a loopback port (a scripted scheduler behind it): frames of the
epoch being fetched reach the results queue, whole even when they come on
the data socket; others are dropped; a stream that fails says so."""
import queue

from dpex.client.streams import Received, StreamPool
from dpex.proto import worker_pb2 as wpb
from dpex.testing import wait_until
from dpex.wire import parse_frame
from tests.unit.test_worker_service import worker  # noqa: F401 - the fixture: a Worker service on loopback


def address_of(channel) -> str:
    return channel._channel.target().decode().removeprefix("dns:///")


def take(pool: StreamPool, n: int) -> list[Received]:
    return [pool.results.get(timeout=10) for _ in range(n)]


def test_frames_of_the_epoch_come_whole_and_others_are_dropped(worker):  # noqa: F811
    scheduler, channel = worker
    scheduler.size = lambda seq: (300 << 10) if seq == 2 else 50  # seq 2 comes on the data socket
    pool = StreamPool(shared_memory=False)
    try:
        address = address_of(channel)
        pool.start_epoch((1, 0, 5))
        pool.send(address, wpb.FetchRequest(job_id=1, consumer_index=0, epoch=4, seq=9))  # an earlier epoch's
        pool.send(address, wpb.FetchRequest(job_id=1, consumer_index=0, epoch=5, seq=1, more_seqs=[2]))
        received = take(pool, 2)
        got = sorted((parse_frame(r.frame)[0].seq, len(parse_frame(r.frame)[1])) for r in received)
        assert got == [(1, 50), (2, 300 << 10)] and {r.address for r in received} == {address}
        assert len(scheduler.requests) == 3 and pool.results.empty()  # epoch 4's batch 9 came, and went
    finally:
        pool.close()
    wait_until(lambda: len(scheduler.cancelled) == 1, 10, "the worker's side of the stream to close too")


def test_a_stream_to_a_worker_that_is_not_there_fails_into_the_results():
    pool = StreamPool(shared_memory=False)
    try:
        pool.send("127.0.0.1:1", wpb.FetchRequest(job_id=1, seq=0))
        failed = pool.results.get(timeout=30)
        assert failed.frame is None and failed.address == "127.0.0.1:1" and failed.error is not None
    finally:
        pool.close()


def test_the_end_of_an_epoch_drops_what_is_queued_for_it(worker):  # noqa: F811
    _, channel = worker
    pool = StreamPool(shared_memory=False)
    try:
        pool.start_epoch((1, 0, 0))
        pool.send(address_of(channel), wpb.FetchRequest(job_id=1, seq=0, more_seqs=[1, 2]))
        first = pool.results.get(timeout=10)
        assert parse_frame(first.frame)[0].seq in (0, 1, 2)
        pool.end_epoch((1, 0, 0))
        pool.start_epoch((1, 0, 1))
        pool.send(address_of(channel), wpb.FetchRequest(job_id=1, epoch=1, seq=0))
        later = pool.results.get(timeout=10)
        assert parse_frame(later.frame)[0].epoch == 1  # the old epoch's frames went
        try:
            pool.results.get_nowait()
            raise AssertionError("nothing else is queued")
        except queue.Empty:
            pass
    finally:
        pool.close()


def test_the_end_of_a_left_epoch_keeps_the_news_of_the_next_one():
    # A peek's epoch is ended by the reaper thread while the next peek's control thread
    # already put its first owners on the lane's queue: taken with the old epoch's frames,
    # the next epoch never learnt who owns its batches and waited for ever (CI, test_scripts).
    pool = StreamPool(shared_memory=False)
    try:
        pool.start_epoch((1, 0, 4))
        news, broken = ("owners", (1, 0, 5)), Received("127.0.0.1:1", None, ConnectionError("reset"))
        pool.results.put(news)
        pool.results.put(broken)
        pool.end_epoch((1, 0, 4))
        assert [pool.results.get_nowait() for _ in range(2)] == [news, broken]
        pool.start_epoch((1, 0, 5))
        pool.end_epoch((1, 0, 4))  # late, after the next began: the next one's epoch stays
        assert pool._epoch == ((1, 0, 5), 0)
    finally:
        pool.close()


def test_a_frame_of_the_same_epochs_earlier_attempt_is_not_taken():
    """The same loader's epoch begun again (a new iter()) is another plan under the same batch numbers:
    a frame made for the left one's plan is not the new one's (issue 58)."""
    from dpex.wire import build_frame
    from dpex.wire.batchkey import Key
    pool = StreamPool(shared_memory=False)
    try:
        pool.start_epoch((1, 0, 4), attempt=7)
        for attempt, taken in ((6, False), (7, True), (0, True)):  # 0: a worker that does not say
            frame = build_frame(Key(4, 0, 0, 1, attempt).header())
            assert (pool.wanted(Received("127.0.0.1:1", frame, None)) is not None) == taken
        pool.end_epoch((1, 0, 4), attempt=6)  # the left one's end: the new one's epoch stays
        assert pool._epoch == ((1, 0, 4), 7)
    finally:
        pool.close()
