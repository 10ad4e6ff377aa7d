"""The worker's data port: batch frames to trainers on other hosts over a
plain TCP socket, beside their gRPC Fetch stream.

grpcio's Python API hands every received message over as ``bytes`` built by
copying its slices twice; a trainer reading a frame from a socket straight
into its own buffer (``recv_into``) copies it once, in the kernel. The Fetch
stream still carries the order and the metadata: for each frame it sends a
small pointer (``Batch.data_size``) and the frame's bytes follow, in the
same order, on the stream's socket.

Pairing: a trainer that wants it sends "dpex-data" metadata on Fetch; the
worker answers in its initial metadata with this port and a fresh random key;
the trainer connects and sends the key; the Fetch stream, authenticated like
every call, claims the socket with that key. A socket whose key no stream
claims is closed. Off under TLS: the payloads would cross in the clear.
"""
from __future__ import annotations

import logging
import queue
import secrets
import socket
import threading
import time

log = logging.getLogger("dpex.worker")

KEY_BYTES = 16
REQUEST_METADATA = "dpex-data"
PORT_METADATA, KEY_METADATA = "dpex-data-port", "dpex-data-key"
_UNCLAIMED_S = 30.0   # a socket no stream claims in this time is closed
_MAX_PENDING = 1024


class DataPort:
    def __init__(self, host: str, port: int = 0) -> None:
        self._listener = socket.create_server((host or "0.0.0.0", port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._pending: dict[bytes, tuple[socket.socket, float]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="dpex-data-accept", daemon=True)
        self._thread.start()

    @staticmethod
    def new_key() -> bytes:
        return secrets.token_bytes(KEY_BYTES)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._handshake, args=(conn,), name="dpex-data-handshake",
                             daemon=True).start()

    def _handshake(self, conn: socket.socket) -> None:
        """Reads the key (garbage or silence: closed after a few seconds)."""
        try:
            conn.settimeout(5.0)
            key = b""
            while len(key) < KEY_BYTES:
                chunk = conn.recv(KEY_BYTES - len(key))
                if not chunk:
                    raise OSError("closed before its key")
                key += chunk
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            conn.close()
            return
        with self._cond:
            now = time.monotonic()
            for old in [k for k, (_, t) in self._pending.items() if now - t > _UNCLAIMED_S]:
                self._pending.pop(old)[0].close()
            if self._closed or len(self._pending) >= _MAX_PENDING:
                conn.close()
                return
            self._pending[key] = (conn, now)
            self._cond.notify_all()

    def claim(self, key: bytes, timeout_s: float) -> socket.socket | None:
        """The socket that sent ``key``, once it arrives (None after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while key not in self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return None
                self._cond.wait(remaining)
            return self._pending.pop(key)[0]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            pending, self._pending = list(self._pending.values()), {}
            self._cond.notify_all()
        for conn, _ in pending:
            conn.close()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (a close alone does not)
        except OSError:
            pass
        self._listener.close()
        if self._thread is not threading.current_thread():
            self._thread.join()


class Sender:
    """Writes one stream's frames to its data socket, in order, in a thread
    of its own (the Fetch stream yields the pointers meanwhile)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dpex-data-send", daemon=True)
        self._thread.start()

    def send(self, frame: bytes) -> None:
        self._queue.put(frame)

    def _run(self) -> None:
        while True:
            frame = self._queue.get()
            if frame is None:
                return
            if self.failed is not None:
                continue
            try:
                self._conn.sendall(frame)
            except OSError as e:
                self.failed = e
                log.debug("data socket failed: %s", e)

    def close(self) -> None:
        self._queue.put(None)
        try:
            self._conn.shutdown(socket.SHUT_RDWR)  # a blocked sendall returns
        except OSError:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._conn.close()
