"""Runs the dispatcher service on a gRPC server."""
from __future__ import annotations

import logging
from concurrent import futures

import grpc

from dpex.config import DispatcherConfig
from dpex.dispatcher.service import DispatcherService
from dpex.dispatcher.waiters import MAX_POLLS
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.auth import server_credentials
from dpex.metrics import MetricsServer, dispatcher_metrics
from dpex.rpc import add_health, listen, server_interceptors, server_options

log = logging.getLogger("dpex.dispatcher")


class DispatcherServer:
    """A running dispatcher; ``address`` is where it listens."""

    def __init__(self, config: DispatcherConfig) -> None:
        self.config = config
        self.service = DispatcherService(config)
        # Heartbeats and syncs long-poll, each holding a thread (made as needed):
        # room for MAX_POLLS of them and for the calls that do not wait.
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=MAX_POLLS + 128,
                                                              thread_name_prefix="dpex-rpc"),
                                   options=server_options(config.max_message_bytes), interceptors=server_interceptors(config.auth_token))
        dgrpc.add_DispatcherServicer_to_server(self.service, self._server)
        self._health = add_health(self._server, "dpex.v1.Dispatcher")
        self.port = listen(self._server, f"{config.host}:{config.port}",
                           server_credentials(config.tls_cert_file, config.tls_key_file))
        self._closed = False
        try:
            self.metrics = (MetricsServer(config.host, config.metrics_port,
                                          lambda: dispatcher_metrics(self.service.status()))
                            if config.metrics_port is not None else None)
        except BaseException:
            self.service.close()
            raise
        self._server.start()
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "[::]") else config.host
        self.address = f"{host}:{self.port}"
        log.info("dispatcher listening on %s:%d (%s); %s", config.host, self.port,
                 "TLS" if config.tls_cert_file else "plaintext",
                 "auth: a token is required on every call" if config.auth_token else
                 "auth: NONE - anyone who can reach this port may call it; jobs (shipped code) are "
                 + ("accepted from anywhere (--allow-unauthenticated)" if config.allow_unauthenticated
                    else "accepted from loopback peers only"))

    def wait(self) -> None:
        self._server.wait_for_termination()

    def close(self, grace_s: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._health.enter_graceful_shutdown()  # probes see NOT_SERVING from here on
        if self.metrics is not None:
            self.metrics.close()
        self.service.close()
        self._server.stop(grace_s).wait()
