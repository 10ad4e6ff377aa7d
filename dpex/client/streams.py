"""One bidirectional Fetch stream per worker, shared by a loader's epochs.

Requests go out through a queue; a receiver thread per stream puts every
frame (or the stream's failure) on the loader's results queue.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py.
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from typing import Any, Callable, NamedTuple

import grpc

from dpex.client.buffers import FramePool
from dpex.proto import worker_pb2 as wpb
from dpex.errors import DpexWireError
from dpex.rpc import channel
from dpex.wire import parse_frame
from dpex.wire.batchkey import EpochKey
from dpex import shm
from dpex.shm import host_id
from dpex.wire.pairing import HOST_METADATA, KEY_METADATA, PORT_METADATA, REQUEST_METADATA

log = logging.getLogger("dpex.client")


class Received(NamedTuple):
    address: str
    frame: Any                    # bytes or a buffer (dpex.client.buffers); None: the stream failed
    error: BaseException | None = None  # why the stream failed, or (a frame) why it did not parse
    meta: wpb.Batch | None = None  # the frame's header, parsed once here (None: it did not parse)
    payload: Any = None            # the frame's payload, a view of it
    receive_s: float = 0.0         # seconds its bytes took to read off the data socket (0: none came on one)


def drop_file(meta: wpb.Batch) -> None:
    """A hand-off file for a frame we do not take: remove it (only a real one)."""
    if meta.shm_path and shm.is_handoff_path(meta.shm_path):
        shm.discard(shm.Handoff(meta.shm_path, meta.shm_size))


def _connect(address: str, port: int, key: bytes) -> socket.socket:
    """The data socket to a worker, keyed to our Fetch stream; a dead peer is
    noticed by TCP keepalive in about 20 s (as gRPC's keepalive)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    sock = socket.create_connection((host, port), timeout=10)
    try:
        sock.sendall(key)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 2)):
            if hasattr(socket, option):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    except OSError:
        sock.close()
        raise
    return sock


def _follow(sock: socket.socket, pointer: bytes, read: Callable[[socket.socket, int], Any]) -> tuple[Any, float]:
    """The frame a pointer names, read from the data socket by ``read``, and
    the seconds that took; a frame sent whole in gRPC as it is (0 s)."""
    meta, _ = parse_frame(pointer)
    if not meta.data_size:
        return pointer, 0.0
    begun = time.perf_counter()
    frame = read(sock, meta.data_size)
    return frame, time.perf_counter() - begun


class _Stream:
    def __init__(self, address: str, pool: "StreamPool", token: str | None,
                 tls_ca: bytes | None, host: str) -> None:
        self.address = address
        self._pool = pool
        self._results = pool.results
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False
        self._channel = channel(address, token, tls_ca)
        fetch = self._channel.stream_stream(
            "/dpex.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString,
            response_deserializer=None)  # frames stay bytes: parsed without copies later
        # Our host id: a worker on the same host sends /dev/shm file names, not bytes.
        # Without TLS, we ask for a data socket: frames then come on it, read
        # straight into our buffers (dpex.worker.dataport).
        self._want_data = tls_ca is None and pool.data_socket
        metadata = ((HOST_METADATA, host),) if host else ()
        if self._want_data:
            metadata += ((REQUEST_METADATA, "1"),)
        self._sock: socket.socket | None = None
        self._call = fetch(iter(self._requests.get, None), metadata=metadata or None)
        # daemon=True only so that interpreter exit reaches the loader's
        # finalizer, which closes the stream (the real stop path).
        self._thread = threading.Thread(target=self._receive, name=f"dpex-recv-{address}", daemon=True)
        self._thread.start()

    def send(self, request: wpb.FetchRequest) -> None:
        self._requests.put(request)

    def _receive(self) -> None:
        try:
            if self._want_data:
                answer = dict(self._call.initial_metadata() or ())
                if PORT_METADATA in answer:
                    port = int(answer[PORT_METADATA])
                    try:
                        self._sock = _connect(self.address, port, bytes.fromhex(answer[KEY_METADATA]))
                    except OSError as e:  # a firewall, say: from now on, bytes in gRPC messages
                        log.warning("cannot reach worker %s's data port %d (%s); receiving batches in gRPC "
                                    "messages instead", self.address, port, e)
                        self._pool.data_socket = False
                        raise
            for frame in self._call:
                receive_s = 0.0
                if self._sock is not None:
                    frame, receive_s = _follow(self._sock, frame, self._pool.read_frame)
                received = self._pool.wanted(Received(self.address, frame, receive_s=receive_s))
                if received is not None:
                    self._results.put(received)
            error: BaseException = ConnectionError(f"worker {self.address} closed the stream")
        except grpc.RpcError as e:
            error = e
        except (OSError, ValueError, DpexWireError) as e:
            error = ConnectionError(f"data socket to worker {self.address}: {e}")
        except Exception as e:  # e.g. no memory for a frame: a failed stream, asked again, never a silent stop
            error = ConnectionError(f"receiving from worker {self.address}: {type(e).__name__}: {e}")
        if not self._closing:
            self._results.put(Received(self.address, None, error))

    def close(self) -> None:
        self._closing = True
        self._requests.put(None)  # ends the request iterator
        self._call.cancel()
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # a receiver blocked in recv returns
            except OSError:
                pass
        if self._thread is not threading.current_thread():
            self._thread.join()
        if sock is not None:
            sock.close()
        self._channel.close()


class StreamPool:
    def __init__(self, token: str | None = None, tls_ca: bytes | None = None,
                 shared_memory: bool = True) -> None:
        self.token, self.tls_ca = token, tls_ca
        self.host = host_id() if shared_memory else ""
        self.data_socket = True  # ask workers on other hosts for a data socket (dpex.worker.dataport)
        # How a frame on a data socket is read; pinning reads into pinned memory (dpex.client.pinning).
        self.read_frame: Callable[[socket.socket, int], Any] = FramePool()
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._epoch: tuple[EpochKey, int] | None = None  # being fetched, and its plan's attempt

    def start_epoch(self, key: EpochKey, attempt: int = 0) -> None:
        with self._lock:
            self._epoch = (key, attempt)

    def wanted(self, received: Received) -> Received | None:
        """A frame received, with its header parsed, if it is for the epoch being
        fetched (or does not parse: the fetcher says what is wrong with it).
        Others (a left or earlier epoch's) are dropped here, their hand-off files at once."""
        try:
            meta, payload = parse_frame(received.frame)
        except DpexWireError as e:
            return received._replace(error=e)
        epoch = self._epoch
        # A frame of the same epoch's earlier attempt (the same loader's epoch begun again) is not this one's.
        if epoch is not None and EpochKey.of(meta) == epoch[0] and (not meta.attempt or meta.attempt == epoch[1]):
            return received._replace(meta=meta, payload=payload)
        drop_file(meta)
        return None

    def end_epoch(self, key: EpochKey, attempt: int = 0) -> None:
        """The epoch ended or was left: the frames queued for it go now (unless
        a newer epoch started meanwhile: its fetcher drops what is not its own).
        The rest stays: a left epoch is ended from another thread (dpex.client.fetcher's
        reaper) while the next one's control thread may already have news for it."""
        with self._lock:  # not between a newer epoch's start and its first frames
            if self._epoch != (key, attempt):
                return
            self._epoch = None
            kept = []
            while True:
                try:
                    item = self.results.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Received) and item.frame is not None:
                    self.wanted(item)
                else:  # news for the fetchers (who drop another epoch's), a broken stream
                    kept.append(item)
            for item in kept:
                self.results.put(item)

    def send(self, address: str, request: wpb.FetchRequest) -> None:
        with self._lock:
            stream = self._streams.get(address)
            if stream is None:
                stream = self._streams[address] = _Stream(address, self, self.token, self.tls_ca, self.host)
        stream.send(request)

    def drop(self, address: str) -> None:
        with self._lock:
            stream = self._streams.pop(address, None)
        if stream is not None:
            stream.close()

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
