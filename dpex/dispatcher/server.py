"""Runs the dispatcher service on a gRPC server.

The server is ``grpc.aio`` on an event loop of its own thread: the two long
polls (worker heartbeats, trainer syncs) are coroutines, so a fleet of
workers polling costs futures, not a thread each; the short calls (register,
submit a plan, ...) run in a small thread pool, as on a threaded server.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures
from typing import Any, Coroutine

import grpc

from dpex.config import DispatcherConfig
from dpex.dispatcher.service import DispatcherService
from dpex.proto import dispatcher_pb2 as dpb
from dpex.auth import server_credentials
from dpex.metrics import MetricsServer, dispatcher_metrics
from dpex.rpc import add_async_health, add_servicer, listen, server_interceptors, server_options

log = logging.getLogger("dpex.dispatcher")


# Calls that arrived and wait for the loop to take them. gRPC's defaults (a
# soft limit of 1,000, then random early refusal up to 3,000) cancelled some
# of a fleet's heartbeats when 1,500 came at once (a restarted dispatcher, a
# fleet started together).
FLEET_OPTIONS = [
    ("grpc.server.max_pending_requests", 20_000),
    ("grpc.server.max_pending_requests_hard_limit", 40_000),
]


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (a tenth less CPU under a fleet, see
    benchmarks/RESULTS.md §13), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class DispatcherServer:
    """A running dispatcher; ``address`` is where it listens."""

    def __init__(self, config: DispatcherConfig) -> None:
        self.config = config
        self.service = DispatcherService(config)
        self._closed = False
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dpex-rpc-loop", daemon=True)
        self._thread.start()
        self.metrics = None
        try:
            self._server, self._health, self.port = self._run(self._start(config))
            self.metrics = (MetricsServer(config.host, config.metrics_port,
                                          lambda: dispatcher_metrics(self.service.status()))
                            if config.metrics_port is not None else None)
        except BaseException:
            self.close(0)
            raise
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "[::]") else config.host
        self.address = f"{host}:{self.port}"
        log.info("dispatcher listening on %s:%d (%s); %s", config.host, self.port,
                 "TLS" if config.tls_cert_file else "plaintext",
                 "auth: a token is required on every call" if config.auth_token else
                 "auth: NONE - anyone who can reach this port may call it; jobs (shipped code) are "
                 + ("accepted from anywhere (--allow-unauthenticated)" if config.allow_unauthenticated
                    else "accepted from loopback peers only"))

    async def _start(self, config: DispatcherConfig) -> tuple[grpc.aio.Server, Any, int]:
        server = grpc.aio.server(futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="dpex-rpc"),
                                 options=server_options(config.max_message_bytes) + FLEET_OPTIONS,
                                 interceptors=server_interceptors(config.auth_token, aio=True))
        add_servicer(server, self.service, dpb.DESCRIPTOR.services_by_name["Dispatcher"])
        health = await add_async_health(server, "dpex.v1.Dispatcher")
        port = listen(server, f"{config.host}:{config.port}",
                      server_credentials(config.tls_cert_file, config.tls_key_file))
        await server.start()
        return server, health, port

    def _run(self, coroutine: Coroutine) -> Any:
        """Runs ``coroutine`` on the server's loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def wait(self) -> None:
        self._thread.join()

    def close(self, grace_s: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        server = getattr(self, "_server", None)
        if server is not None:
            self._run(self._health.enter_graceful_shutdown())  # probes see NOT_SERVING from here on
        if self.metrics is not None:
            self.metrics.close()
        self.service.close()  # wakes the long polls, which answer at once
        if server is not None:
            self._run(server.stop(grace_s))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
