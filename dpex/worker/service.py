"""The Worker gRPC service: a trainer's Fetch stream sends one request per
batch it wants (its credits) and receives the frames as they are ready."""
from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from typing import Callable

import grpc

from dpex.proto import worker_pb2 as wpb
from dpex.rpc import servicer_method
from dpex.wire import build_frame, parse_frame
from dpex import shm
from dpex.worker.dataport import DataPort, Sender
from dpex.shm import Handoff
from dpex.wire.pairing import HOST_METADATA, KEY_METADATA, PORT_METADATA, REQUEST_METADATA
from dpex.worker.scheduler import Key, Scheduler

log = logging.getLogger("dpex.worker")

_SERVICE = "dpex.v1.Worker"
_DATA_MIN_BYTES = 64 << 10  # smaller frames stay in the gRPC message: a pointer would save nothing
_UNMAPPED_KEPT = 4096  # far more than a trainer's window: older pointer frames were mapped long ago


def oversize_frame(frame: bytes, limit: int, worker_address: str) -> bytes:
    """The error frame sent instead of a batch bigger than the worker's limit."""
    meta, _ = parse_frame(frame)
    error = wpb.Batch(job_id=meta.job_id, consumer_index=meta.consumer_index, epoch=meta.epoch, seq=meta.seq)
    error.error.CopyFrom(wpb.RemoteError(
        type="DpexWireError", stage="send", sample_index=-1, worker=worker_address,
        message=f"the batch is {len(frame) / 2**20:.1f} MiB, over this worker's message limit of "
                f"{limit / 2**20:.1f} MiB (dpex-worker --max-message-mb); use smaller batches "
                "or raise the limit (trainers accept up to 1 GiB)"))
    return build_frame(error)


class WorkerService:
    def __init__(self, scheduler: Scheduler, inspect: Callable[[int], bytes], *,
                 max_frame_bytes: int, worker_address: str, shared_memory: bool = True,
                 spare_files: int = 0, data_port: DataPort | None = None) -> None:
        """``spare_files``: hand-off files kept for reuse once sent (dpex.shm);
        ``data_port``: frames to trainers that ask go over a socket of it (dpex.worker.dataport)."""
        self._data_port = data_port
        self._scheduler = scheduler
        self._inspect = inspect
        self._max_frame = max_frame_bytes
        self._address = worker_address
        self._meter = scheduler.meter
        self._host = shm.host_id() if shared_memory else ""
        self._spares = spare_files

    def handler(self) -> grpc.GenericRpcHandler:
        # Responses are pre-serialized Batch frames built by the pool's
        # processes: no response_serializer, the bytes go out as they are.
        return grpc.method_handlers_generic_handler(_SERVICE, {
            "Fetch": grpc.stream_stream_rpc_method_handler(
                self.Fetch, request_deserializer=wpb.FetchRequest.FromString),
            "Inspect": grpc.unary_unary_rpc_method_handler(
                servicer_method(self.Inspect), request_deserializer=wpb.InspectRequest.FromString),
        })

    def Inspect(self, request, context):
        return self._inspect(request.job_id)  # already serialized by the pool

    def Fetch(self, request_iterator, context: grpc.ServicerContext):
        out: queue.SimpleQueue = queue.SimpleQueue()
        sink = out.put
        context.add_callback(lambda: out.put(None))  # the RPC ended: stop yielding

        def read() -> None:
            try:
                for r in request_iterator:
                    for seq in (r.seq, *r.more_seqs):
                        self._scheduler.request(Key(r.epoch, seq, r.consumer_index, r.job_id), sink)
            except Exception as e:  # the client went away mid-message
                log.debug("fetch stream closed: %s", e)

        # The reader ends with the RPC (its iterator ends or raises).
        reader = threading.Thread(target=read, name="dpex-fetch-reader", daemon=True)
        reader.start()
        metadata = tuple(context.invocation_metadata())
        same_host = bool(self._host) and (HOST_METADATA, self._host) in metadata
        sender = None
        if (REQUEST_METADATA, "1") in metadata:  # answered at once: the trainer waits for it
            if same_host:
                context.send_initial_metadata(())  # no socket: it maps /dev/shm files
            else:
                sender = self._data_socket(context)
        pointed: deque[Handoff] = deque(maxlen=_UNMAPPED_KEPT)  # files named to a same-host trainer
        self._meter.stream(+1)
        try:
            while True:
                frame = out.get()
                if frame is None:
                    return
                self._meter.sent(shm.size_of(frame))
                if same_host and isinstance(frame, Handoff):
                    pointed.append(frame)
                outgoing = self._outgoing(frame, same_host)
                if sender is not None and len(outgoing) >= _DATA_MIN_BYTES:
                    if sender.failed is not None:
                        context.abort(grpc.StatusCode.UNAVAILABLE, f"data socket failed: {sender.failed}")
                    sender.send(outgoing)  # the bytes, on the socket, in the order of the pointers
                    meta, _ = parse_frame(outgoing)
                    meta.data_size = len(outgoing)
                    outgoing = build_frame(meta)
                yield outgoing
        finally:
            if sender is not None:
                sender.close()
            self._meter.stream(-1)
            self._scheduler.cancel(sink)
            while not out.empty():  # asked for, produced, never sent
                shm.discard(out.get())
            for frame in pointed:  # named but never mapped (a mapped one was renamed): the trainer left
                shm.discard(frame)

    def _data_socket(self, context: grpc.ServicerContext) -> Sender | None:
        """Pairs this stream with the trainer's data socket (None: it stays on gRPC)."""
        if self._data_port is None:
            context.send_initial_metadata(())
            return None
        key = self._data_port.new_key()
        context.send_initial_metadata(((PORT_METADATA, str(self._data_port.port)), (KEY_METADATA, key.hex())))
        conn = self._data_port.claim(key, timeout_s=10.0)
        if conn is None:
            log.warning("a trainer asked for a data socket but did not connect; sending over gRPC")
            return None
        return Sender(conn)

    def _outgoing(self, frame: "bytes | Handoff", same_host: bool) -> bytes:
        """What goes on the wire: the file's name for a same-host trainer,
        else the frame's bytes (an error frame if over the size limit)."""
        if isinstance(frame, Handoff):
            if same_host:
                meta = wpb.Batch.FromString(frame.meta)
                meta.shm_path, meta.shm_size, meta.shm_offset = frame.path, frame.size, frame.offset
                return build_frame(meta)
            frame = shm.take(frame, self._spares)
        if len(frame) > self._max_frame:
            return oversize_frame(frame, self._max_frame, self._address)
        return frame
