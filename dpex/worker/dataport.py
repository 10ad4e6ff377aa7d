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
every call, claims the socket with that key. Only keys the worker handed out
(to authenticated streams, not yet claimed) are taken: a socket that sends
another is closed at once, and each source address may have only a few
sockets that have not sent their key yet, so a flood of strangers costs the
port no thread and no memory beyond those. Off under TLS: the payloads would
cross in the clear.
"""
from __future__ import annotations

import logging
import queue
import secrets
import socket
import threading
import time
from typing import Callable

from dpex.wire.pairing import KEY_BYTES

log = logging.getLogger("dpex.worker")

_UNCLAIMED_S = 30.0   # a socket no stream claims in this time is closed
_HANDSHAKE_S = 5.0    # to send its key
_MAX_HANDSHAKES_PER_HOST = 16  # sockets of one source address still to send their key


class DataPort:
    def __init__(self, host: str, port: int = 0) -> None:
        self._listener = socket.create_server((host or "0.0.0.0", port), backlog=128)
        self.port = self._listener.getsockname()[1]
        self._cond = threading.Condition()
        self._pending: dict[bytes, tuple[socket.socket, float]] = {}
        self._issued: set[bytes] = set()  # keys handed out and not claimed yet
        self._handshakes: dict[str, int] = {}  # source address -> sockets still to send their key
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="dpex-data-accept", daemon=True)
        self._thread.start()

    def new_key(self) -> bytes:
        """A key for one stream's socket; :meth:`claim` it (which ends it, socket or not)."""
        key = secrets.token_bytes(KEY_BYTES)
        with self._cond:
            self._issued.add(key)
        return key

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            with self._cond:
                busy = self._handshakes.get(peer[0], 0) >= _MAX_HANDSHAKES_PER_HOST
                if not busy:
                    self._handshakes[peer[0]] = self._handshakes.get(peer[0], 0) + 1
            if busy:  # a flood from that address: not one more thread for it
                conn.close()
                continue
            threading.Thread(target=self._handshake, args=(conn, peer[0]), name="dpex-data-handshake",
                             daemon=True).start()

    def _handshake(self, conn: socket.socket, host: str) -> None:
        """Reads the key: a key not handed out, garbage or silence closes the socket."""
        try:
            key = self._read_key(conn)
        finally:
            with self._cond:
                self._handshakes[host] -= 1
                if not self._handshakes[host]:
                    del self._handshakes[host]
        with self._cond:
            if key is None or key not in self._issued or key in self._pending or self._closed:
                conn.close()
                return
            now = time.monotonic()
            for old in [k for k, (_, t) in self._pending.items() if now - t > _UNCLAIMED_S]:
                self._pending.pop(old)[0].close()
            self._pending[key] = (conn, now)
            self._cond.notify_all()

    @staticmethod
    def _read_key(conn: socket.socket) -> bytes | None:
        try:
            conn.settimeout(_HANDSHAKE_S)
            key = b""
            while len(key) < KEY_BYTES:
                chunk = conn.recv(KEY_BYTES - len(key))
                if not chunk:
                    return None
                key += chunk
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return key
        except OSError:
            return None

    def claim(self, key: bytes, timeout_s: float) -> socket.socket | None:
        """The socket that sent ``key`` (from :meth:`new_key`), once it arrives
        (None after ``timeout_s``); either way the key is spent."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            try:
                while key not in self._pending:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed:
                        return None
                    self._cond.wait(remaining)
                return self._pending.pop(key)[0]
            finally:
                self._issued.discard(key)

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

    def __init__(self, conn: socket.socket, sent: Callable[[float], None] = lambda seconds: None) -> None:
        """``sent(seconds)``: a frame was written, that long after it was given to :meth:`send`."""
        self._conn = conn
        self._sent = sent
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="dpex-data-send", daemon=True)
        self._thread.start()

    def send(self, frame: bytes, due: float | None = None) -> None:
        """Writes ``frame`` after those before it; its time counted from ``due`` (now if None)."""
        self._queue.put((frame, time.monotonic() if due is None else due))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.failed is not None:
                continue
            frame, due = item
            try:
                self._conn.sendall(frame)
                self._sent(time.monotonic() - due)
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
