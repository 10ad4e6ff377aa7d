"""Runs the dispatcher service on a gRPC server.

The server is ``grpc.aio`` on an event loop of its own thread: the two long
polls (worker heartbeats, trainer syncs) are coroutines, so a fleet of
workers polling costs futures, not a thread each; the short calls (register,
submit a plan, ...) run in a small thread pool, as on a threaded server.

grpc.aio's server takes new calls one at a time, one per turn of its event
loop (its accept loop awaits each call before it asks for the next). When a
fleet's calls come in bursts (the ranks of a DDP job finish their splits
together, and every worker that held one asks for the next), new calls
queued behind the burst's work: at 1,000 workers heartbeats took 40-75 ms
at p99 while their handlers took under 15 ms. So the dispatcher runs
``ACCEPTORS`` servers on one event loop and one port (SO_REUSEPORT; the
kernel spreads connections among them), which take as many new calls a
turn: 10-12 ms (benchmarks/RESULTS.md §15). The port is checked free first,
so a second daemon on it fails instead of sharing it.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from concurrent import futures
from typing import Any, Coroutine

import grpc

from dpex.aio import LoopThread
from dpex.config import DispatcherConfig
from dpex.dispatcher.core import DispatcherCore
from dpex.dispatcher.reaper import Reaper
from dpex.dispatcher import page
from dpex.dispatcher.service import DispatcherService
from dpex.proto import dispatcher_pb2 as dpb
from dpex.auth import Tokens, certificate, is_loopback_host, server_credentials
from dpex import metrics
from dpex.latency import Latencies
from dpex.metrics import MetricsServer, dispatcher_metrics
from dpex.errors import DpexConfigError
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


# Servers sharing the port (see above).
ACCEPTORS = 4


def check_port_free(host: str, port: int) -> None:
    """Raises DpexConfigError if something listens on ``host:port`` (the
    servers bind it with SO_REUSEPORT, which would not fail on their own)."""
    if port == 0:
        return
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror:
        return  # gRPC says what is wrong with the host
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # connections closing there are fine
        try:
            probe.bind(address)
        except OSError as e:
            raise DpexConfigError(f"cannot listen on {host}:{port}: {e.strerror} (another dispatcher "
                                  "there?)") from None


class DispatcherServer:
    """A running dispatcher; ``address`` is where it listens."""

    def __init__(self, config: DispatcherConfig) -> None:
        self.config = config
        self.tokens = Tokens(config.auth_token, config.auth_token_file)
        self.certificate = certificate(config.tls_cert_file, config.tls_key_file)  # None: plaintext
        self.rpc_seconds = Latencies()  # each call's handler, by method
        self.core = DispatcherCore(config)
        if self.core.store is not None:
            self.core.store.on_failing = self._journal_failing
        self.reaper = Reaper(self.core).start()
        self.service = DispatcherService(self.core)
        self._closed = False
        self._loop_thread = LoopThread("dpex-rpc-loop")
        self._loop = self._loop_thread.loop
        self.metrics = None
        self._servers: list[grpc.aio.Server] = []
        self._healths: list[Any] = []
        try:
            self.port = self._run(self._start(config))
            self.metrics = (MetricsServer(config.host, config.metrics_port,
                                          self._metrics,
                                          pages=page.pages(self.core.status), tls=self.certificate)
                            if config.metrics_port is not None else None)
        except BaseException:
            self.close(0)
            raise
        host = "127.0.0.1" if config.host in ("0.0.0.0", "::", "[::]") else config.host
        self.address = f"{host}:{self.port}"
        # Without a token, listening beyond loopback: said as a warning (calls are answered from loopback
        # peers only, or, with --allow-unauthenticated, from anyone on the network).
        exposed = not config.auth_token and not is_loopback_host(config.host)
        log.log(logging.WARNING if exposed else logging.INFO, "dispatcher listening on %s:%d (%s); %s",
                config.host, self.port, "TLS" if config.tls_cert_file else "plaintext",
                "auth: a token is required on every call" if config.auth_token else
                "auth: NONE - calls (jobs with their shipped code, status, epochs) are "
                + ("accepted from anywhere (--allow-unauthenticated)" if config.allow_unauthenticated
                   else "accepted from loopback peers only"))

    async def _start(self, config: DispatcherConfig) -> int:
        """Starts the servers; the port they share."""
        check_port_free(config.host, config.port)
        # The short calls' threads, shared by the servers.
        self._pool = pool = futures.ThreadPoolExecutor(max_workers=32, thread_name_prefix="dpex-rpc")
        options = [o for o in server_options(config.max_message_bytes) if o[0] != "grpc.so_reuseport"]
        port = config.port
        for _ in range(ACCEPTORS):
            server = grpc.aio.server(pool, options=options + FLEET_OPTIONS + [("grpc.so_reuseport", 1)],
                                     interceptors=server_interceptors(self.tokens, aio=True,
                                                                      latencies=self.rpc_seconds))
            add_servicer(server, self.service, dpb.DESCRIPTOR.services_by_name["Dispatcher"])
            self._healths.append(await add_async_health(server, "dpex.v1.Dispatcher"))
            self._servers.append(server)
            port = listen(server, f"{config.host}:{port}",  # 0: the first picks, the others join it
                          server_credentials(self.certificate))
            await server.start()
        return port

    def _metrics(self) -> list:
        """The status's metrics, and what it does not carry: latencies, the journal's size, failures by kind."""
        status, seen, store = self.core.status(), self.core.seen, self.core.store
        names = {str(j.job_id): j.name for j in status.jobs}
        waits = Latencies()  # labelled by job id and name, as the status's job metrics are
        for (job_id,), counts, sum_s in seen.waits.series():
            waits.add(counts, sum_s, job_id, names.get(job_id, ""))
        out = [*dispatcher_metrics(status),
               metrics.histogram("dpex_rpc_seconds", "Seconds each call took to answer, by method (long polls "
                                 "included: a heartbeat or a sync may wait for news).", self.rpc_seconds, ["method"]),
               metrics.histogram("dpex_job_wait_seconds", "Seconds the job's trainers waited in next() for each "
                                 "batch, as they reported with their syncs.", waits, ["job_id", "job_name"]),
               metrics.errors("dpex_errors", "Failures by kind: consumers released after --consumer-timeout "
                              "without a sync (consumer_timeout), calls refused (auth), journal writes that "
                              "failed (journal_write).",
                              {"consumer_timeout": seen.consumer_timeouts,
                               "auth": sum(status.refused_calls_total.values()),
                               "journal_write": status.journal_write_errors_total},
                              ("consumer_timeout", "auth", "journal_write"))]
        if store is not None:
            out += metrics.journal_metrics(*store.size, store.snapshots_written, store.sync_seconds)
        return out

    def _journal_failing(self, failing: bool) -> None:
        """Health says NOT_SERVING while the journal cannot be written (its
        disk is full): a probe sees the outage the callers see."""
        from grpc_health.v1 import health_pb2
        status = health_pb2.HealthCheckResponse.NOT_SERVING if failing else health_pb2.HealthCheckResponse.SERVING
        for health in self._healths:
            for name in ("", "dpex.v1.Dispatcher"):
                asyncio.run_coroutine_threadsafe(health.set(name, status), self._loop)

    def reload(self) -> None:
        """SIGHUP: the token file read again now (the TLS files are, at the next connection after a change)."""
        self.tokens.reload()

    async def _stop(self, grace_s: float) -> None:
        await asyncio.gather(*(server.stop(grace_s) for server in self._servers))

    def _run(self, coroutine: Coroutine) -> Any:
        """Runs ``coroutine`` on the server's loop and returns its result."""
        return self._loop_thread.run(coroutine)

    def wait(self) -> None:
        self._loop_thread.join()

    def close(self, grace_s: float = 1.0) -> None:
        if self._closed:
            return
        self._closed = True
        for health in self._healths:
            self._run(health.enter_graceful_shutdown())  # probes see NOT_SERVING from here on
        if self.metrics is not None:
            self.metrics.close()
        # In that order: the long polls end (UNAVAILABLE: clients ride it out), the servers take no
        # new call and finish those in flight, then the journal closes, after the last update.
        self.core.stop_serving()
        if self._servers:
            self._run(self._stop(grace_s))
        self.reaper.stop()
        self.core.close()
        if self._servers:
            self._pool.shutdown(wait=False)
        self._loop_thread.close()
