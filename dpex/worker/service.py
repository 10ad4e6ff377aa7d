"""The Worker gRPC service: a trainer's Fetch stream sends one request per
batch it wants (its credits) and receives the frames as they are ready.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import deque
from concurrent.futures import Executor
from typing import Callable

import grpc

from dpex.proto import worker_pb2 as wpb
from dpex.rpc import Malformed, parser, servicer_method
from dpex import errors
from dpex.log import Seldom
from dpex.errors import DpexAuthError, DpexWorkerError
from dpex.keys import Refusals
from dpex.wire import build_frame, parse_frame
from dpex import shm
from dpex.worker.dataport import DataPort, Sender
from dpex.shm import Handoff
from dpex.wire.pairing import HOST_METADATA, KEY_METADATA, PORT_METADATA, REQUEST_METADATA
from dpex.wire.batchkey import Key
from dpex.worker.scheduler import Scheduler

log = logging.getLogger("dpex.worker")

_SERVICE = "dpex.v1.Worker"
_DATA_MIN_BYTES = 64 << 10  # smaller frames stay in the gRPC message: a pointer would save nothing
_UNMAPPED_KEPT = 4096  # far more than a trainer's window: older pointer frames were mapped long ago


def oversize_frame(frame: bytes, limit: int, worker_address: str) -> bytes:
    """The error frame sent instead of a batch bigger than the worker's limit."""
    meta, _ = parse_frame(frame)
    error = wpb.Batch(job_id=meta.job_id, consumer_index=meta.consumer_index, epoch=meta.epoch, seq=meta.seq)
    error.error.CopyFrom(errors.remote(
        DpexWorkerError, f"the batch is {len(frame) / 2**20:.1f} MiB, over this worker's message limit of "
                         f"{limit / 2**20:.1f} MiB (dpex-worker --max-message-mb); use smaller batches "
                         "or raise the limit (trainers accept up to 1 GiB)", stage="send", worker=worker_address))
    return build_frame(error)


class _Outbox:
    """A stream's frames: put by the scheduler's threads (it is the sink the
    stream's requests name), taken on the server's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self._closed = False

    def __call__(self, frame: "bytes | Handoff") -> None:
        try:
            self._loop.call_soon_threadsafe(self._arrive, frame)
        except RuntimeError:  # the loop is closed: the worker stopped
            shm.discard(frame)

    def _arrive(self, frame: "bytes | Handoff") -> None:
        if self._closed:
            shm.discard(frame)
        else:
            self._queue.put_nowait(frame)

    def put_nowait(self, item: object) -> None:
        """From the loop: ``item`` is taken next (a :class:`_Refused`)."""
        self._queue.put_nowait(item)

    async def get(self) -> "bytes | Handoff":
        return await self._queue.get()

    def close(self) -> None:
        """Discards what came and what comes (from any thread, once the
        scheduler has forgotten this sink: what it put before is ahead of this)."""
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            self._drain()

    def _drain(self) -> None:
        self._closed = True
        while not self._queue.empty():
            shm.discard(self._queue.get_nowait())


class StreamLimit:
    """The open Fetch streams (one per loader and worker), at most ``limit``:
    a stream holds no thread, only memory. Used on the server's loop."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0
        self.refused = 0  # counted for dpex_worker_fetch_refused_total
        self._seldom = Seldom()

    def open(self) -> bool:
        if self.count >= self.limit:
            return False
        self.count += 1
        return True

    def close(self) -> None:
        self.count -= 1

    def refusal(self, peer: str, worker_address: str) -> str:
        """Counts a refused stream and says why (in the log at most once a minute)."""
        self.refused += 1
        message = (f"worker {worker_address} serves at most {self.limit} open loaders (dpex-worker "
                   "--max-loaders) and all are open; close loaders no longer used (a loader keeps its "
                   "stream between epochs), start more workers or raise the limit")
        if self._seldom.due():
            log.warning("refused a loader from %s: %d open loaders, the limit (--max-loaders); %d refused "
                        "so far", peer, self.count, self.refused)
        return message


class _Refused:
    """Put in a stream's outbox by its reader: the stream ends with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code, self.message = code, message


def open_to_all(peer: str) -> bool:
    return True


class WorkerService:
    def __init__(self, scheduler: Scheduler, inspect: Callable[[int], bytes], *,
                 max_frame_bytes: int, worker_address: str, blocking: Executor, max_streams: int,
                 is_job_key: Callable[[int, bytes], bool | None], refusals: Refusals,
                 open_to: Callable[[str], bool] = open_to_all,
                 shared_memory: bool = True, spare_files: int = 0, data_port: DataPort | None = None) -> None:
        """``blocking``: threads for a stream's blocking steps; ``max_streams``:
        open Fetch streams at most (:class:`StreamLimit`); ``is_job_key(job_id,
        key)``: whether a request's key is its job's (None: not known yet);
        ``open_to(peer)``: whether that peer may call at all (without a token,
        loopback peers only); ``spare_files``: hand-off files kept for reuse
        once sent (dpex.shm); ``data_port``: frames to trainers that ask go
        over a socket of it (dpex.worker.dataport)."""
        self._blocking = blocking
        self._is_job_key, self._refusals, self._open_to = is_job_key, refusals, open_to
        self.streams = StreamLimit(max_streams)
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
                self.Fetch, request_deserializer=parser(wpb.FetchRequest)),
            "Inspect": grpc.unary_unary_rpc_method_handler(
                servicer_method(self.Inspect), request_deserializer=parser(wpb.InspectRequest)),
        })

    def Inspect(self, request, context):
        self._admit(context.peer())
        if not self._is_job_key(request.job_id, request.job_key):
            raise self._refusals.refuse("job key", context.peer(), self._no_key(request.job_id, "Inspect"))
        return self._inspect(request.job_id)  # already serialized by the pool

    def _admit(self, peer: str) -> None:
        if not self._open_to(peer):
            raise self._refusals.refuse("not loopback", peer, (
                f"worker {self._address} has no auth token, so it serves loopback peers only; give the "
                "cluster a token (--auth-token-file / DPEX_AUTH_TOKEN) or --allow-unauthenticated"))

    @staticmethod
    def _no_key(job_id: int, call: str) -> str:
        return (f"{call} names job {job_id} without its key: only the loaders that made or joined a job "
                "fetch its batches")

    async def Fetch(self, request_iterator, context: grpc.aio.ServicerContext):
        """A coroutine on the server's loop: an open stream holds no thread,
        only its requests and the frames on their way; the blocking steps
        (the scheduler's lock, reading a file, pairing a socket) run in
        ``blocking``'s threads."""
        loop = asyncio.get_running_loop()
        try:
            self._admit(context.peer())
        except DpexAuthError as e:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        if not self.streams.open():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                self.streams.refusal(context.peer(), self._address))
        out = _Outbox(loop)

        async def read() -> None:
            keyed: set[tuple[int, bytes]] = set()  # (job, key) pairs checked already
            try:
                async for r in request_iterator:
                    if isinstance(r, Malformed):
                        out.put_nowait(_Refused(grpc.StatusCode.INVALID_ARGUMENT, str(r.error)))
                        return
                    if (r.job_id, r.job_key) not in keyed:
                        refused = self._refusal(r, context.peer())
                        if refused is not None:
                            out.put_nowait(refused)
                            return
                        keyed.add((r.job_id, r.job_key))
                    await loop.run_in_executor(self._blocking, self._request, r, out)
            except Exception as e:  # the client went away mid-message
                log.debug("fetch stream closed: %s", e)

        reader = loop.create_task(read())  # ends with the RPC (its iterator ends or raises)
        sender = None
        pointed: deque[Handoff] = deque(maxlen=_UNMAPPED_KEPT)  # files named to a same-host trainer
        self._meter.stream(+1)
        try:
            metadata = tuple(context.invocation_metadata() or ())
            same_host = bool(self._host) and (HOST_METADATA, self._host) in metadata
            if (REQUEST_METADATA, "1") in metadata:  # answered at once: the trainer waits for it
                if same_host:
                    await context.send_initial_metadata(())  # no socket: it maps /dev/shm files
                else:
                    sender = await self._data_socket(context)
            while True:
                frame = await out.get()
                due = time.monotonic()  # sent from here: the rest of its time is the network's (or trainer's)
                if isinstance(frame, _Refused):
                    await context.abort(frame.code, frame.message)
                self._meter.sent(shm.size_of(frame))
                if same_host and isinstance(frame, Handoff):
                    pointed.append(frame)
                if isinstance(frame, Handoff) and not same_host:  # its bytes are read from the file
                    outgoing = await loop.run_in_executor(self._blocking, self._outgoing, frame, same_host)
                else:
                    outgoing = self._outgoing(frame, same_host)
                if sender is not None and len(outgoing) >= _DATA_MIN_BYTES:
                    if sender.failed is not None:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"data socket failed: {sender.failed}")
                    sender.send(outgoing, due)  # the bytes, on the socket, in the order of the pointers
                    meta, _ = parse_frame(outgoing)
                    meta.data_size = len(outgoing)
                    yield build_frame(meta)  # its send time is the socket's (Sender)
                    continue
                yield outgoing
                self._meter.sending(time.monotonic() - due)
        finally:
            reader.cancel()
            self._meter.stream(-1)
            self.streams.close()
            # Off the loop (a lock, a thread joined); the frames that came meanwhile are discarded.
            await asyncio.shield(loop.run_in_executor(self._blocking, self._end, out, sender, list(pointed)))

    def _refusal(self, r: wpb.FetchRequest, peer: str) -> "_Refused | None":
        """Why a request is refused (None: it is not)."""
        ok = self._is_job_key(r.job_id, r.job_key)
        if ok is None:  # no secret yet: asked again once this worker has registered
            return _Refused(grpc.StatusCode.UNAVAILABLE, f"worker {self._address} has not registered yet")
        if not ok:
            error = self._refusals.refuse("job key", peer, self._no_key(r.job_id, "Fetch"))
            return _Refused(grpc.StatusCode.PERMISSION_DENIED, str(error))
        return None

    def _request(self, r: wpb.FetchRequest, sink: Callable) -> None:
        for seq in (r.seq, *r.more_seqs):
            self._scheduler.request(Key(r.epoch, seq, r.consumer_index, r.job_id, r.attempt), sink)

    def _end(self, out: "_Outbox", sender: Sender | None, pointed: list[Handoff]) -> None:
        """A stream ended: its socket closed, its requests forgotten, its
        frames asked for, produced and never sent (or named and never mapped:
        a mapped one was renamed) discarded."""
        if sender is not None:
            sender.close()
        self._scheduler.cancel(out)
        out.close()
        for frame in pointed:
            shm.discard(frame)

    async def _data_socket(self, context: grpc.aio.ServicerContext) -> Sender | None:
        """Pairs this stream with the trainer's data socket (None: it stays on gRPC)."""
        if self._data_port is None:
            await context.send_initial_metadata(())
            return None
        key = self._data_port.new_key()
        await context.send_initial_metadata(((PORT_METADATA, str(self._data_port.port)), (KEY_METADATA, key.hex())))
        conn = await asyncio.get_running_loop().run_in_executor(
            self._blocking, functools.partial(self._data_port.claim, key, timeout_s=10.0))
        if conn is None:
            log.warning("a trainer asked for a data socket but did not connect; sending over gRPC")
            return None
        return Sender(conn, self._meter.sending)

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
