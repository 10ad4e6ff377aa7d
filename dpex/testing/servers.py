"""A service's handlers on a ``grpc.aio`` server of their own, on a loopback
port, as the daemons serve them (dpex.aio): for tests of one service."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from concurrent import futures
from typing import Iterator

import grpc

from dpex.aio import LoopThread


@contextlib.contextmanager
def serving(*handlers: grpc.GenericRpcHandler) -> Iterator[str]:
    """Serves ``handlers`` until the block ends; yields the address."""
    loop = LoopThread("dpex-test-rpc")
    threads = futures.ThreadPoolExecutor(8, thread_name_prefix="dpex-test-rpc")

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(threads)
        server.add_generic_rpc_handlers(handlers)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = loop.run(start())
    try:
        yield f"127.0.0.1:{port}"
    finally:
        loop.run(server.stop(None))
        threads.shutdown(wait=False)
        loop.close()


@contextlib.contextmanager
def slow_link(upstream: str, first_answer_s: float) -> Iterator[str]:
    """A TCP proxy to ``upstream`` whose answers on each connection start ``first_answer_s`` late, as a
    peer's over a slow link or on a loaded host: its HTTP/2 handshake takes that long. Yields its address."""
    host, port = upstream.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    sockets: list[socket.socket] = [listener]

    def pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            first = True
            while chunk := src.recv(1 << 16):
                if first:
                    time.sleep(delay)
                    first = False
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    threads: list[threading.Thread] = []

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # the listener shut down
                return
            try:
                server = socket.create_connection((host, int(port)))
            except OSError:  # the upstream is gone: so is this connection
                client.close()
                continue
            sockets.extend((client, server))
            for src, dst, delay in ((client, server, 0.0), (server, client, first_answer_s)):
                threads.append(threading.Thread(target=pump, args=(src, dst, delay), name="dpex-test-slow-link",
                                                daemon=True))
                threads[-1].start()

    threads.append(threading.Thread(target=accept, name="dpex-test-slow-link", daemon=True))
    threads[0].start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        # A shutdown wakes a thread blocked in accept() or recv() on its socket (a close alone does not):
        # the listener's first, so that no connection comes after the others'.
        for each in sockets:
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)
            if each is listener:
                threads[0].join(10)
        for thread in threads:
            thread.join(10)
        for each in sockets:
            each.close()
