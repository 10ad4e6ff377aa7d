import logging
"""One epoch's iterator (dpex.client.fetcher) against real gRPC servers on
loopback ports that play the dispatcher (owners, acks) and a worker (the
Worker service over a scripted scheduler): batches come in plan order,
user errors are raised at their batch and the epoch goes on (as torch's
DataLoader), duplicates and a corrupt frame cost nothing, and a batch that
never comes is a timeout naming it."""
import threading
from concurrent import futures

import grpc
import pytest
import torch

from dpex.client.fetcher import EpochFetcher
from dpex.client.streams import StreamPool
from dpex.errors import DpexTimeoutError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.proto import worker_pb2 as wpb
from dpex.testing import wait_until
from dpex.wire import build_frame, encode_parts, frame_parts
from dpex.worker.meter import Meter
from dpex.keys import Refusals
from dpex.testing.servers import serving
from dpex.worker.service import WorkerService

N = 12


class Dispatcher(dgrpc.DispatcherServicer):
    """Names one worker the owner of the whole epoch; long-polls like the real one."""

    def __init__(self) -> None:
        self.worker = ""
        self.acked: set[int] = set()
        self.epoch = 0  # the consumer's plan: an earlier epoch's sync is NOT_FOUND, as the real one's
        self._stop = threading.Event()

    def SyncConsumer(self, request, context):
        if request.epoch != self.epoch:
            context.abort(grpc.StatusCode.NOT_FOUND, f"job 3 has no plan for consumer 0 epoch {request.epoch}")
        self.acked.update(request.delivered_seqs)
        if request.owners_digest == b"1":
            self._stop.wait(min(request.wait_s, 0.5))  # nothing new: the long poll runs out
        return dpb.SyncConsumerResponse(owners=[dpb.SplitOwner(split_id=1, first_seq=0, num_batches=N,
                                                               worker_id="w1", worker_address=self.worker)],
                                        workers_alive=1, owners_digest=b"1")


class Worker:
    """The scheduler behind the Worker service: batch ``seq`` is {"seq": seq};
    ``fail`` seqs are a ZeroDivisionError in __getitem__, ``twice`` are sent
    twice, ``corrupt`` once corrupt then whole, ``never`` never come."""

    def __init__(self) -> None:
        self.meter = Meter(1)
        self.fail, self.twice, self.corrupt, self.never = set(), set(), set(), set()

    def request(self, key, sink) -> None:
        meta = wpb.Batch(job_id=key.job_id, consumer_index=key.consumer_index, epoch=key.epoch, seq=key.seq)
        if key.seq in self.never:
            return
        if key.seq in self.fail:
            meta.error.CopyFrom(wpb.RemoteError(type="ZeroDivisionError", type_ref="builtins:ZeroDivisionError",
                                                message="division by zero", stage="getitem", sample_index=key.seq))
            sink(build_frame(meta))
            return
        frame = b"".join(frame_parts(meta, encode_parts({"seq": torch.tensor(key.seq)})))
        if key.seq in self.corrupt:
            self.corrupt.discard(key.seq)
            sink(frame[:-3] + b"\xff\xff\xff")
            return
        for _ in range(2 if key.seq in self.twice else 1):
            sink(frame)

    def cancel(self, sink) -> None:
        pass


@pytest.fixture
def cluster():
    dispatcher, worker = Dispatcher(), Worker()
    server = grpc.server(futures.ThreadPoolExecutor(8))
    dgrpc.add_DispatcherServicer_to_server(dispatcher, server)
    dispatcher_address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    service = WorkerService(worker, lambda job_id: b"", max_frame_bytes=1 << 20, worker_address="w",
                            shared_memory=False, blocking=futures.ThreadPoolExecutor(4), max_streams=100,
                            is_job_key=lambda job_id, key: True, refusals=Refusals(logging.getLogger()))
    with serving(service.handler()) as worker_address:
        dispatcher.worker = worker_address
        channel = grpc.insecure_channel(dispatcher_address)
        streams = StreamPool(shared_memory=False)

        def epoch(**kwargs) -> EpochFetcher:
            options = dict(stub=dgrpc.DispatcherStub(channel), target="the dispatcher", streams=streams, job_id=3,
                           consumer_index=0, epoch=0, num_batches=N, window=4, ordered=True, timeout_s=30,
                           retry_for_s=5)
            return EpochFetcher(**{**options, **kwargs})
        yield dispatcher, worker, epoch
        dispatcher._stop.set()
        streams.close()
        channel.close()
    server.stop(None)


def test_an_epoch_comes_in_plan_order_and_every_batch_is_acked(cluster):
    dispatcher, worker, epoch = cluster
    worker.twice, worker.corrupt = {2, 7}, {5}
    fetcher = epoch()
    assert len(fetcher) == N
    assert [b["seq"].item() for b in fetcher] == list(range(N))
    assert fetcher.finished and fetcher.progress.count == N
    wait_until(lambda: dispatcher.acked == set(range(N)), 10, "every batch acked")


def test_a_user_error_is_raised_at_its_batch_and_the_epoch_goes_on(cluster):
    _, worker, epoch = cluster
    worker.fail = {4}
    fetcher = epoch(ordered=False)
    got, errors = [], []
    while True:
        try:
            got.append(next(fetcher)["seq"].item())
        except ZeroDivisionError as e:
            errors.append(str(e))
        except StopIteration:
            break
    assert sorted(got) == [s for s in range(N) if s != 4] and len(errors) == 1
    assert "division by zero" in errors[0]


def test_a_batch_that_never_comes_is_a_timeout_that_names_it(cluster):
    _, worker, epoch = cluster
    worker.never = {6}
    fetcher, got = epoch(timeout_s=1.5, ordered=False), []
    with pytest.raises(DpexTimeoutError, match=r"no batch arrived for 1.5s; 1 batches missing \(seq 6\)"):
        for batch in fetcher:
            got.append(batch["seq"].item())
    assert sorted(got) == [s for s in range(N) if s != 6]


def test_a_left_epochs_control_news_is_not_the_next_epochs(cluster):
    """A lane's next epoch starts before the left one is ended (its iterator was
    collected; the reaper ends it later): the left epoch's control thread, told
    by the dispatcher that its plan was replaced, fails on the queue both share.
    The next epoch reads on (found in CI: a peek inside the loop, on the lane of
    the peek before it, raised "no plan for consumer 0 epoch 3")."""
    dispatcher, _, epoch = cluster
    left = epoch()
    assert next(left)["seq"].item() == 0
    dispatcher.epoch = 1  # the next epoch's plan replaces the left one's
    following = epoch(epoch=1)
    wait_until(lambda: not left._control._thread.is_alive(), 10, "the left epoch's control to fail")
    assert [b["seq"].item() for b in following] == list(range(N))
    left.close()


def test_the_reaper_takes_an_epoch_a_finalizer_hands_it_from_inside_its_own_put():
    # The garbage collector runs finalizers wherever it is triggered, also inside _Reaper.put while that makes
    # its thread: that finalizer puts another epoch, in the same thread. With a plain lock the trainer hung
    # (the differential tester's long run, zip(loader, loader)).
    from dpex.client import fetcher as fetching
    reaper, ended = fetching._Reaper(), []
    start = reaper._start_thread

    def collected_meanwhile():  # as the collector would, once
        reaper._start_thread = start
        reaper.put(lambda: ended.append("the collected epoch"))
        return start()
    reaper._start_thread = collected_meanwhile
    putting = threading.Thread(target=reaper.put, args=(lambda: ended.append("the left epoch"),), daemon=True)
    putting.start()
    putting.join(10)
    assert not putting.is_alive(), "put() hung on its own lock"
    reaper.drain(10)
    assert sorted(ended) == ["the collected epoch", "the left epoch"]


def test_an_epoch_ends_the_same_loaders_epoch_of_its_own_key_first_and_never_another_loaders():
    """Issue 55 (the tester: a checkpoint into the same loader): a dropped iterator's end is the reaper
    thread's, later (or the collector's, for one held in a reference cycle); an epoch of the same (job,
    consumer, epoch) begun again by the same loader must not be released by it, so end_left runs it now and
    waits for its release. Another loader's epoch of the same named job is left alone (its newcomer is
    refused by the dispatcher), and so is another epoch."""
    from dpex.client import fetcher as fetching

    class Quiet:  # a control thread, and the streams, that have nothing to stop
        def close(self, flush):
            pass

        def end_epoch(self, key, attempt=0):
            pass
    leaves, releasing = [], threading.Event()

    def leave(wait):
        releasing.wait(10)  # the dispatcher answers when the test says
        leaves.append(wait)

    def exit_of(key, client_id):
        end = fetching._Exit(Quiet(), leave, Quiet(), key, client_id)
        fetching._live.add(end)
        return end
    ours, theirs, later = exit_of((1, 0, 0), 7), exit_of((1, 0, 0), 8), exit_of((1, 0, 1), 7)
    try:
        ending = threading.Thread(target=fetching.end_left, args=((1, 0, 0), 7))
        ending.start()
        ending.join(0.2)
        assert ending.is_alive()  # waiting for the dispatcher's answer to the release
        releasing.set()
        ending.join(10)
        assert leaves == [True]  # ours, told and waited for; not the other loader's, not epoch 1
        assert theirs in fetching._live and later in fetching._live and ours not in fetching._live
        ours()  # the reaper's turn comes: nothing more
        assert leaves == [True]
    finally:
        for end in (theirs, later):
            fetching._live.discard(end)
