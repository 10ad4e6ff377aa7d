"""Runs a worker: gRPC server, process pool, scheduler and dispatcher agent."""
from __future__ import annotations

import ipaddress
import logging
import os
import shutil
import socket
import threading
from concurrent import futures
from typing import Any

import grpc

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from dpex.aio import LoopThread
from dpex.config import WorkerConfig
from dpex.errors import BATCH_ERROR_KINDS, DpexConfigError
from dpex import auth
from dpex.auth import Tokens, certificate, answers, is_loopback_host, server_credentials
from dpex.keys import Refusals
from dpex import metrics
from dpex.latency import Latencies
from dpex.metrics import MetricsServer, build_info, load_metrics
from dpex.version import versions
from dpex.procutil import temp_dir
from dpex.rpc import add_async_health, listen, server_interceptors, server_options
from dpex import shm
from dpex.worker.agent import DispatcherAgent
from dpex.worker.dataport import DataPort
from dpex.worker.meter import Meter
from dpex.worker.pool import BatchPool
from dpex.worker.runtime import inspect
from dpex.worker import stream
from dpex.worker.scheduler import Scheduler
from dpex.worker.service import WorkerService

_SWEEP_EVERY_S = 5.0
log = logging.getLogger("dpex.worker")


def advertised_host(config: WorkerConfig) -> str:
    """The address trainers should use: the interface that reaches the dispatcher."""
    if config.advertise_host:
        return config.advertise_host
    if config.host not in ("0.0.0.0", "::", "[::]", ""):
        return config.host
    host = config.dispatcher.rsplit(":", 1)[0].strip("[]")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks a route
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def check_code_source(config: WorkerConfig) -> None:
    """Workers run code that arrives through the dispatcher: without a token,
    only from a loopback dispatcher, unless allow_unauthenticated."""
    if config.auth_token or config.allow_unauthenticated:
        return
    host = config.dispatcher.rsplit(":", 1)[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        loopback = False
    if not loopback:
        raise DpexConfigError(
            f"this worker would run code shipped through {config.dispatcher} without authentication; "
            "give dispatcher and workers a token (--auth-token-file / DPEX_AUTH_TOKEN) or pass "
            "--allow-unauthenticated")


def check_data_paths(paths: tuple[str, ...]) -> None:
    """A worker serves only where the data it was told to expect is (paths
    may name environment variables): one that started without it would fail
    every job that reads it."""
    missing = [p for p in map(os.path.expandvars, paths) if not os.path.exists(p)]
    if missing:
        raise DpexConfigError(
            f"this node ({socket.gethostname()}) has no {', '.join(missing)}: copy the data there (or mount "
            "it) before starting a worker here; the datasets' DatasetSpecs name paths on the workers")


class WorkerServer:
    def __init__(self, config: WorkerConfig, pool: BatchPool | None = None, job_dir: str | None = None) -> None:
        """``pool``: batch processes made before this server (an embedded
        worker forks them before it runs any thread); default: a new pool.
        ``job_dir``: this worker's directory, made with them (dpex.worker.daemon.fork_first);
        default: a new one."""
        check_code_source(config)
        check_data_paths(config.data_paths)
        self.config = config
        self.tokens = Tokens(config.auth_token, config.auth_token_file)
        self.certificate = certificate(config.tls_cert_file, config.tls_key_file)  # None: plaintext
        self.rpc_seconds = Latencies()  # each unary call's handler, by method
        self._closed = False
        self.pool = pool  # type: ignore[assignment]  # closed by close() if the start fails
        # grpc.aio on a loop of its own: an open Fetch stream is a coroutine, not a
        # thread, so loaders are bounded by memory (and --max-loaders), and health
        # answers however many are open. Inspect (it may build a dataset) runs in
        # the server's threads, a stream's blocking steps in threads of their own.
        self._loop = LoopThread("dpex-rpc-loop")
        self._rpc_threads = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="dpex-rpc")
        self._stream_threads = futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="dpex-fetch")
        try:
            self._server, port = self._loop.run(self._listen(config))
        except BaseException:
            self._loop.close()
            raise
        self.address = f"{advertised_host(config)}:{port}"
        self._job_dir = job_dir or temp_dir("worker")  # named by pid: a later worker removes it if we are killed
        if pool is None:
            self.pool = BatchPool(config.processes, self.address, shared_memory=config.shared_memory,
                                  handoff_min_bytes=config.shm_min_bytes, in_turn=config.in_turn,
                                  sample_budgets=(config.sample_cache_bytes, config.sample_disk_bytes))
        else:
            pool.set_address(self.address)
        self.agent: DispatcherAgent | None = None
        self.metrics: MetricsServer | None = None
        self.data_port: DataPort | None = None
        try:
            self.scheduler = Scheduler(self.pool, self._job_path, out_of_order=self._out_of_order,
                                       share_digest=self._share_digest, share_bytes=config.share_cache_bytes,
                                       sample_dirs=tuple(os.path.join(d, "samples") for d in
                                                         (self.pool.handoff_dir, self._job_dir) if d),
                                       buffer_batches=config.buffer_batches,
                                       buffer_bytes=config.buffer_bytes,
                                       max_inflight=2 * config.processes,
                                       worker_address=self.address, meter=Meter(config.processes))
            if config.data_port is not None and not config.tls_cert_file:
                self.data_port = DataPort(config.host, config.data_port)
            self.refusals = Refusals(log)
            self.service = WorkerService(self.scheduler, self._inspect, max_frame_bytes=config.max_message_bytes,
                                         worker_address=self.address, blocking=self._stream_threads,
                                         max_streams=config.max_loaders, is_job_key=self._is_job_key,
                                         refusals=self.refusals, open_to=self._open_to,
                                         shared_memory=config.shared_memory,
                                         spare_files=config.processes, data_port=self.data_port)
            self._health = self._loop.run(self._serve(self.service))
            if config.metrics_port is not None:  # scraped as soon as it serves, while it may still wait for the dispatcher
                self.metrics = MetricsServer(config.host, config.metrics_port, self._metrics, tls=self.certificate)
            self.agent = DispatcherAgent(config, self.address, self.scheduler, self._job_dir, self.tokens,
                                         on_refused=self._refused_by_dispatcher)
            self.agent.start()
            self._stopping = threading.Event()
            self._janitor = threading.Thread(target=self._sweep, name="dpex-shm-janitor", daemon=True)
            self._janitor.start()
        except BaseException:
            self.close()
            raise
        exposed = not config.auth_token and not is_loopback_host(config.host)  # said as a warning
        log.log(logging.WARNING if exposed else logging.INFO, "worker serving on %s (%s) with %d processes; %s",
                self.address, "TLS" if config.tls_cert_file else "plaintext", config.processes,
                "auth: a token is required on every call" if config.auth_token else
                "auth: NONE - batches are served to " + ("anyone who can reach this port (--allow-unauthenticated)"
                                                         if config.allow_unauthenticated else "loopback peers only"))

    async def _listen(self, config: WorkerConfig) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(self._rpc_threads,
                                 options=server_options(4 << 20),  # trainers send only small requests
                                 interceptors=server_interceptors(self.tokens, aio=True, latencies=self.rpc_seconds))
        return server, listen(server, f"{config.host}:{config.port}",
                              server_credentials(self.certificate))

    def reload(self) -> None:
        """SIGHUP: the token file read again now (the TLS files are, at the next connection after a change)."""
        self.tokens.reload()

    def _refused_by_dispatcher(self, refused: bool) -> None:
        """Health says NOT_SERVING while the dispatcher refuses this worker's token (a rotation it
        missed): a probe sees a worker that gets no work."""
        from grpc_health.v1 import health_pb2
        status = health_pb2.HealthCheckResponse.NOT_SERVING if refused else health_pb2.HealthCheckResponse.SERVING
        for name in ("", "dpex.v1.Worker"):
            self._loop.run(self._health.set(name, status))

    async def _serve(self, service: WorkerService) -> Any:
        """Adds the services and starts serving; the health servicer."""
        self._server.add_generic_rpc_handlers((service.handler(),))
        health = await add_async_health(self._server, "dpex.v1.Worker")
        await self._server.start()
        return health

    def _metrics(self) -> list:
        held = GaugeMetricFamily("dpex_worker_splits_held", "Splits this worker holds.")
        held.add_metric([], len(self.scheduler.held_split_ids()))
        busy = CounterMetricFamily("dpex_worker_busy_seconds", "Process-seconds spent producing batches.")
        busy.add_metric([], self.scheduler.meter.busy_seconds())
        shm_bytes = GaugeMetricFamily("dpex_worker_shm_bytes", "Bytes of hand-off files in /dev/shm: frame (not yet "
                                      "sent or mapped), lent (mapped by a trainer), spare (kept for reuse).",
                                      labels=["kind"])
        for kind, size in shm.usage(self.pool.handoff_dir).items():
            shm_bytes.add_metric([kind], size)
        ready = GaugeMetricFamily("dpex_worker_consumer_ready_batches", "Batches made ahead for a consumer, "
                                  "waiting for its request (each holds at most its share of the buffer).",
                                  labels=["job_id", "consumer"])
        ready_bytes = GaugeMetricFamily("dpex_worker_consumer_ready_bytes", "Bytes of those batches.",
                                        labels=["job_id", "consumer"])
        for (job_id, consumer), (batches, nbytes) in self.scheduler.holdings().items():
            ready.add_metric([str(job_id), str(consumer)], batches)
            ready_bytes.add_metric([str(job_id), str(consumer)], nbytes)
        limit = GaugeMetricFamily("dpex_worker_fetch_streams_limit", "Open loaders (Fetch streams) served at "
                                  "most (dpex-worker --max-loaders); dpex_worker_fetch_streams counts the open ones.")
        limit.add_metric([], self.service.streams.limit)
        refused = CounterMetricFamily("dpex_worker_fetch_refused", "Loaders refused: the limit was reached.")
        refused.add_metric([], self.service.streams.refused)
        calls_refused = CounterMetricFamily("dpex_worker_refused_calls", "Calls refused, by reason: a wrong "
                                            "or missing token, a job's key (another job's batches), a peer "
                                            "beyond loopback without a token.", labels=["reason"])
        refusals = self.refusals.counts + auth.refusals.counts
        for reason, count in sorted(refusals.items()):
            calls_refused.add_metric([reason], count)
        meter = self.scheduler.meter
        failed = metrics.errors("dpex_worker_errors", "Failures by kind: batches whose user code raised "
                                "(user_code), whose batch process died (process_death), whose split could not be "
                                "planned (plan) or encoded (wire); calls refused (auth).",
                                {**meter.errors, "auth": sum(refusals.values())}, (*BATCH_ERROR_KINDS, "auth"))
        produce = metrics.histogram("dpex_worker_batch_seconds", "Seconds from a batch's start to made (a "
                                    "wait for a free batch process included).", meter.produce_seconds)
        rpcs = metrics.histogram("dpex_worker_rpc_seconds", "Seconds each unary call took to answer, by method "
                                 "(Fetch streams are not timed).", self.rpc_seconds, ["method"])
        return [build_info(versions()), held, busy, shm_bytes, ready, ready_bytes, limit, refused, calls_refused,
                failed, produce, rpcs, *load_metrics([([], self.scheduler.load())], "dpex_worker_", [])]

    def _is_job_key(self, job_id: int, given: bytes) -> bool | None:
        return None if self.agent is None else self.agent.is_job_key(job_id, given)

    def _open_to(self, peer: str) -> bool:
        """Without a token, loopback peers only (unless --allow-unauthenticated)."""
        return answers(peer, self.config.auth_token, self.config.allow_unauthenticated)

    def _job_path(self, job_id: int) -> str:
        assert self.agent is not None
        return self.agent.job_path(job_id)

    def _out_of_order(self, job_id: int) -> bool:
        assert self.agent is not None
        return self.agent.out_of_order(job_id)

    def _share_digest(self, job_id: int) -> bytes | None:
        assert self.agent is not None
        return self.agent.share_digest(job_id)

    def _inspect(self, job_id: int) -> bytes:
        assert self.agent is not None
        self.agent.ensure_job(job_id)
        return self.pool.submit(inspect, job_id, self._job_path(job_id)).result()

    def wait(self) -> None:
        self._loop.join()

    def _sweep(self) -> None:
        """Every few seconds, removes hand-off files lent to trainers that
        died (they never give them back), and the spares of a worker gone idle."""
        while not self._stopping.wait(_SWEEP_EVERY_S):
            shm.sweep_lent(self.pool.handoff_dir)
            shm.sweep_spares(self.pool.handoff_dir)

    def close(self, grace_s: float | None = None) -> None:
        """Drains: deregisters (the dispatcher re-plans our splits and trainers
        re-route), answers what is in flight for ``grace_s`` (default: the
        config's drain timeout), then kills the batch processes and stops."""
        grace_s = self.config.drain_timeout_s if grace_s is None else grace_s
        if self._closed:
            return
        self._closed = True
        if hasattr(self, "_health"):
            self._loop.run(self._health.enter_graceful_shutdown())  # probes see NOT_SERVING while we drain
        if hasattr(self, "_stopping"):
            self._stopping.set()
            self._janitor.join()
        if self.agent is not None:
            self.agent.close(deregister=True)
        if self.metrics is not None:
            self.metrics.close()
        if hasattr(self, "_server"):
            self._loop.run(self._server.stop(grace_s))
        if self.data_port is not None:
            self.data_port.close()
        if hasattr(self, "scheduler"):
            self.scheduler.close()
        self.pool.close()
        stream.stop_context()  # the streams' forkserver: its socket is in the job directory
        if hasattr(self, "_loop"):
            self._rpc_threads.shutdown(wait=False)
            self._stream_threads.shutdown(wait=False)
            self._loop.close()
        shutil.rmtree(self._job_dir, ignore_errors=True)
