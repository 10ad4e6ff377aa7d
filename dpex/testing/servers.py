"""A service's handlers on a ``grpc.aio`` server of their own, on a loopback
port, as the daemons serve them (dpex.aio): for tests of one service."""
from __future__ import annotations

import contextlib
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
