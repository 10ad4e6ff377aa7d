"""The Worker gRPC service on a real loopback server, in front of a scripted
scheduler: a Fetch stream's requests reach the scheduler and their frames
come back; an oversize frame becomes an error frame; a closed stream is
cancelled; big frames to another host go over the data port."""
import logging
import queue
import socket
from concurrent import futures

import grpc
import pytest

from dpex.keys import Refusals
from dpex.proto import worker_pb2 as wpb
from dpex.wire.pairing import KEY_METADATA, PORT_METADATA, REQUEST_METADATA
from dpex.testing import wait_until
from dpex.testing.servers import serving
from dpex.wire import build_frame, parse_frame
from dpex.worker.dataport import DataPort
from dpex.worker.meter import Meter
from dpex.worker.service import WorkerService

LIMIT = 1 << 20
FORGED = b"forged"  # the one key the fixture's worker refuses
MAX_STREAMS = 3


class Scheduler:
    """Answers each request at once with a frame whose payload is ``size(seq)`` bytes."""

    def __init__(self) -> None:
        self.meter = Meter(1)
        self.requests: list[tuple] = []
        self.cancelled: list = []
        self.size = lambda seq: 10

    def request(self, key, sink) -> None:
        self.requests.append(tuple(key))
        meta = wpb.Batch(job_id=key.job_id, consumer_index=key.consumer_index, epoch=key.epoch, seq=key.seq)
        sink(build_frame(meta, b"p" * self.size(key.seq)))

    def cancel(self, sink) -> None:
        self.cancelled.append(sink)


@pytest.fixture
def worker():
    scheduler, port = Scheduler(), DataPort("127.0.0.1")
    service = WorkerService(scheduler, lambda job_id: wpb.InspectResponse(length=job_id * 10).SerializeToString(),
                            max_frame_bytes=LIMIT, worker_address="test-worker", shared_memory=False,
                            data_port=port, blocking=futures.ThreadPoolExecutor(4), max_streams=MAX_STREAMS,
                            is_job_key=lambda job_id, key: key != FORGED, refusals=Refusals(logging.getLogger()))
    with serving(service.handler()) as address:
        channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)])
        yield scheduler, channel
        channel.close()
    port.close()


def fetch(channel, requests, metadata=()):
    method = channel.stream_stream("/dpex.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString,
                                   response_deserializer=None)
    return method(iter(requests), metadata=metadata)


def test_each_seq_asked_for_is_answered_and_a_closed_stream_is_cancelled(worker):
    scheduler, channel = worker
    asks: queue.SimpleQueue = queue.SimpleQueue()
    call = fetch(channel, iter(asks.get, None))
    asks.put(wpb.FetchRequest(job_id=3, consumer_index=1, epoch=2, seq=0, more_seqs=[1, 5]))
    got = [parse_frame(next(call))[0].seq for _ in range(3)]
    assert got == [0, 1, 5] and scheduler.requests == [(2, 0, 1, 3, 0), (2, 1, 1, 3, 0), (2, 5, 1, 3, 0)]
    assert scheduler.meter.fetch_streams == 1
    call.cancel()  # the trainer left
    wait_until(lambda: len(scheduler.cancelled) == 1 and scheduler.meter.fetch_streams == 0, 10, "the cancel")
    assert scheduler.meter.batches_sent == 3


def test_a_frame_over_the_limit_is_sent_as_an_error_that_says_so(worker):
    scheduler, channel = worker
    scheduler.size = lambda seq: LIMIT + 1
    meta, _ = parse_frame(next(fetch(channel, [wpb.FetchRequest(job_id=1, seq=4)])))
    assert meta.seq == 4 and meta.error.type == "dpex.errors.DpexWorkerError" and meta.error.stage == "send"
    assert "over this worker's message limit of 1.0 MiB" in meta.error.message


def test_inspect_is_forwarded(worker):
    _, channel = worker
    inspect = channel.unary_unary("/dpex.v1.Worker/Inspect", request_serializer=wpb.InspectRequest.SerializeToString,
                                  response_deserializer=wpb.InspectResponse.FromString)
    assert inspect(wpb.InspectRequest(job_id=4), timeout=10).length == 40


def test_big_frames_to_another_host_go_over_the_data_port_in_order(worker):
    scheduler, channel = worker
    scheduler.size = lambda seq: (200 << 10) if seq % 2 else 100  # the small ones stay on gRPC
    asks: queue.SimpleQueue = queue.SimpleQueue()
    call = fetch(channel, iter(asks.get, None), metadata=((REQUEST_METADATA, "1"),))
    answered = dict(call.initial_metadata())
    data = socket.create_connection(("127.0.0.1", int(answered[PORT_METADATA])))
    data.sendall(bytes.fromhex(answered[KEY_METADATA]))
    asks.put(wpb.FetchRequest(job_id=1, seq=0, more_seqs=[1, 2, 3]))
    frames = []
    for _ in range(4):
        meta, payload = parse_frame(next(call))
        if meta.data_size:  # a pointer: the frame follows on the data socket
            buf = bytearray()
            while len(buf) < meta.data_size:
                buf += data.recv(meta.data_size - len(buf))
            meta, payload = parse_frame(bytes(buf))
        frames.append((meta.seq, len(payload)))
    assert frames == [(0, 100), (1, 200 << 10), (2, 100), (3, 200 << 10)]
    asks.put(None)
    call.cancel()
    data.close()


def test_streams_past_the_limit_are_refused_with_a_message_and_counted(worker):
    scheduler, channel = worker
    service_streams = []
    for i in range(MAX_STREAMS):  # open, each answered
        asks: queue.SimpleQueue = queue.SimpleQueue()
        call = fetch(channel, iter(asks.get, None))
        asks.put(wpb.FetchRequest(job_id=1, seq=i))
        assert parse_frame(next(call))[0].seq == i
        service_streams.append((asks, call))
    refused = fetch(channel, iter([wpb.FetchRequest(job_id=1, seq=9)]))
    with pytest.raises(grpc.RpcError) as e:
        next(refused)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"serves at most {MAX_STREAMS} open loaders (dpex-worker --max-loaders)" in e.value.details()
    asks, call = service_streams.pop()
    call.cancel()  # a loader closed: its place is free
    wait_until(lambda: scheduler.meter.fetch_streams == MAX_STREAMS - 1, 10, "the closed stream")
    again = fetch(channel, iter([wpb.FetchRequest(job_id=1, seq=7)]))
    assert parse_frame(next(again))[0].seq == 7
    again.cancel()
    for _, call in service_streams:
        call.cancel()


def test_a_request_without_its_jobs_key_ends_the_stream_refused(worker):
    scheduler, channel = worker
    asks: queue.SimpleQueue = queue.SimpleQueue()
    call = fetch(channel, iter(asks.get, None))
    asks.put(wpb.FetchRequest(job_id=1, seq=0))
    assert parse_frame(next(call))[0].seq == 0
    asks.put(wpb.FetchRequest(job_id=2, seq=0, job_key=FORGED))  # another job's batches, without its key
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "Fetch names job 2 without its key" in e.value.details()
    assert scheduler.requests == [(0, 0, 0, 1, 0)]  # the forged one never reached the scheduler
    inspect = channel.unary_unary("/dpex.v1.Worker/Inspect", request_serializer=wpb.InspectRequest.SerializeToString,
                                  response_deserializer=wpb.InspectResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        inspect(wpb.InspectRequest(job_id=4, job_key=FORGED), timeout=10)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    asks.put(None)
