"""Prometheus metrics of the daemons (``--metrics-port``, prometheus-client).

Each daemon has its own registry with one collector that reads the daemon's
state when scraped, so nothing on the hot path updates metric objects and
the dispatcher's state machine stays pure.
"""
from __future__ import annotations

import logging
import socket
import ssl
import threading
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dpex.errors import DpexConfigError
from dpex.latency import BOUNDS, Latencies

if TYPE_CHECKING:
    from dpex.auth import Certificate
from dpex.proto import dispatcher_pb2 as dpb

log = logging.getLogger("dpex.metrics")

HANDSHAKE_TIMEOUT_S = 10.0  # an HTTPS client that starts no handshake is let go


class _Snapshot(Collector):
    def __init__(self, collect: Callable[[], Iterable[Metric]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Metric]:
        return list(self._collect())


# A page the endpoint serves beside the metrics: its content type and body, made when asked for.
Page = Callable[[], tuple[str, bytes]]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes are not news
        pass


class MetricsServer:
    """An HTTP endpoint serving ``/metrics`` from ``collect`` and the process's
    own ``process_*`` (prometheus-client's WSGI app, as at any path not in
    ``pages``) and each of ``pages`` at its path; ``port`` is where. With
    ``tls`` (the daemon's certificate), HTTPS, as its gRPC port."""

    def __init__(self, host: str, port: int, collect: Callable[[], Iterable[Metric]],
                 pages: Mapping[str, Page] | None = None, tls: Certificate | None = None) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(collect))
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, _resident_memory_bytes, _open_fds...
        metrics, pages = make_wsgi_app(registry), dict(pages or {})

        def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
            page = pages.get(environ.get("PATH_INFO") or "/")
            if page is None:
                return metrics(environ, start_response)
            if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):  # as prometheus-client's /metrics answers
                start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
                return [b""]
            content_type, body = page()
            start_response("200 OK", [("Content-Type", content_type), ("Content-Length", str(len(body))),
                                      ("Cache-Control", "no-store")])
            return [body] if environ["REQUEST_METHOD"] == "GET" else [b""]

        contexts: dict[int, ssl.SSLContext] = {}  # the certificate's version -> its context

        class Server(ThreadingMixIn, WSGIServer):
            daemon_threads = True
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0] if host else socket.AF_INET

            def get_request(self) -> tuple[Any, Any]:
                conn, peer = self.socket.accept()
                if tls is None:
                    return conn, peer
                version, _ = tls.current()  # a renewed certificate is served from the next connection
                if version not in contexts:
                    contexts.clear()
                    contexts[version] = tls.ssl_context()
                # The handshake in the request's own thread (finish_request): a slow client holds only that.
                return contexts[version].wrap_socket(conn, server_side=True, do_handshake_on_connect=False), peer

            def finish_request(self, request: Any, client_address: Any) -> None:
                if tls is not None:
                    request.settimeout(HANDSHAKE_TIMEOUT_S)
                    try:
                        request.do_handshake()
                    except (ssl.SSLError, OSError):  # plaintext at an HTTPS port, an untrusting client: not news
                        return
                    request.settimeout(None)
                super().finish_request(request, client_address)
        try:
            self._server = make_server(host, port, app, Server, handler_class=_Quiet)
        except OSError as e:
            raise DpexConfigError(f"cannot serve metrics on {host}:{port}: {e}") from None
        self._thread = threading.Thread(target=self._server.serve_forever, name="dpex-metrics", daemon=True)
        self._thread.start()
        self.port = self._server.server_port
        self.scheme = scheme = "https" if tls is not None else "http"
        log.info("metrics on %s://%s:%d/metrics%s", scheme, host, self.port,
                 "".join(f", {scheme}://{host}:{self.port}{path}" for path in pages))

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _counter(name: str, doc: str, labels: list[str] | None = None) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=labels)


def histogram(name: str, doc: str, latencies: Latencies, labels: list[str] | None = None) -> Metric:
    """``latencies`` as a Prometheus histogram (``NAME_bucket{le}``, ``_sum``, ``_count``)."""
    family = HistogramMetricFamily(name, doc, labels=labels)
    bounds = [repr(b) for b in BOUNDS] + ["+Inf"]
    for values, counts, sum_s in latencies.series():
        cumulative, running = [], 0
        for bound, count in zip(bounds, counts):
            running += count
            cumulative.append((bound, running))
        family.add_metric(list(values), cumulative, sum_s)
    return family


def errors(name: str, doc: str, by_kind: Mapping[str, int], kinds: Iterable[str]) -> Metric:
    """``NAME_total{kind}``: each of ``kinds`` (0 until it happens), and any other kind counted."""
    family = _counter(name, doc, ["kind"])
    for kind in sorted(set(kinds) | set(by_kind)):
        family.add_metric([kind], by_kind.get(kind, 0))
    return family


def journal_metrics(log_bytes: int, snapshot_bytes: int, compactions: int, fsyncs: Latencies) -> list[Metric]:
    """The dispatcher's journal in --work-dir: its size, compactions and fsyncs."""
    size = _gauge("dpex_journal_bytes", "Bytes of the journal in --work-dir, by file: log (appended since the "
                  "last compaction), snapshot.", ["file"])
    size.add_metric(["log"], log_bytes)
    size.add_metric(["snapshot"], snapshot_bytes)
    compacted = _counter("dpex_journal_compactions", "Snapshots written (the log started again from them) since "
                         "the dispatcher started.")
    compacted.add_metric([], compactions)
    return [size, compacted, histogram("dpex_journal_fsync_seconds", "Seconds each fsync of the journal's log "
                                       "took (one for a group of changes).", fsyncs)]


def load_metrics(loads: list[tuple[list[str], dpb.WorkerLoad]], prefix: str,
                 labels: list[str]) -> list[Metric]:
    """Per-worker load, from a worker itself (no labels, ``dpex_worker_*``) or
    from the heartbeats the dispatcher received (labelled by worker, ``dpex_reported_*``)."""
    families = {
        "busy_fraction": _gauge(f"{prefix}busy_fraction", "Fraction of the batch processes' time spent "
                                "producing batches (last heartbeat window).", labels),
        "buffer_batches": _gauge(f"{prefix}buffer_batches", "Finished batches waiting for a request.", labels),
        "running_batches": _gauge(f"{prefix}running_batches", "Batches being produced.", labels),
        "processes": _gauge(f"{prefix}processes", "Batch-producing processes.", labels),
        "fetch_streams": _gauge(f"{prefix}fetch_streams", "Open Fetch streams from trainers.", labels),
        "batches_produced": _counter(f"{prefix}batches_produced", "Batches produced.", labels),
        "bytes_produced": _counter(f"{prefix}bytes_produced", "Bytes of batch frames produced.", labels),
        "batches_sent": _counter(f"{prefix}batches_sent", "Batch frames sent to trainers.", labels),
        "bytes_sent": _counter(f"{prefix}bytes_sent", "Bytes of batch frames sent to trainers.", labels),
        "share_hits": _counter(f"{prefix}share_hits", "Batches a job got from another job of its definition's "
                               "making (made once, dpex.worker.sharing).", labels),
        "share_misses": _counter(f"{prefix}share_misses", "Batches of jobs that share made here.", labels),
        "share_bytes": _gauge(f"{prefix}share_bytes", "Bytes kept for jobs of one definition.", labels),
        "queued_s": _counter(f"{prefix}queued_seconds", "Seconds the batches sent waited, made, for their "
                             "trainer's request.", labels),
        "send_s": _counter(f"{prefix}send_seconds", "Seconds the batches sent took from due to handed to the "
                           "network (a slow link or trainer).", labels),
        "sample_cache_bytes": _gauge(f"{prefix}sample_cache_bytes", "Bytes of samples kept for jobs with "
                                     "cache='memory' or 'disk' (both tiers).", labels),
    }
    for values, load in loads:
        for field, family in families.items():
            family.add_metric(values, float(getattr(load, field)))
    return list(families.values())


def build_info(versions: dpb.Versions) -> Metric:
    """``dpex_build_info{version, protocol, torch, python} 1``: what the daemon runs (dpex.version)."""
    info = _gauge("dpex_build_info", "What this daemon runs: the dpex release, its protocol, torch and Python.",
                  ["version", "protocol", "torch", "python"])
    info.add_metric([versions.dpex, str(versions.protocol), versions.torch, versions.python], 1)
    return info


def dispatcher_metrics(status: dpb.GetStatusResponse) -> list[Metric]:
    workers = _gauge("dpex_workers", "Registered workers by state.", ["state"])
    for state in ("alive", "lost", "left"):
        workers.add_metric([state], sum(w.state == state for w in status.workers))
    jobs = _gauge("dpex_jobs", "Jobs the dispatcher knows, by state.", ["state"])
    for state in ("running", "idle", "finished"):
        jobs.add_metric([state], sum(j.state == state for j in status.jobs))
    wanted = _gauge("dpex_workers_wanted", "Workers the scaling policy wants now (--max-workers; 0: it does "
                    "not scale).")
    wanted.add_metric([], status.workers_wanted)
    assigned = _counter("dpex_splits_assigned", "Splits handed to workers.")
    assigned.add_metric([], status.splits_assigned_total)
    reassigned = _counter("dpex_splits_reassigned", "Splits taken back from lost or leaving workers.")
    reassigned.add_metric([], status.splits_reassigned_total)
    collected = _counter("dpex_jobs_collected", "Jobs removed after --job-gc-timeout without consumers.")
    collected.add_metric([], status.jobs_collected_total)
    forgotten = _counter("dpex_workers_forgotten", "Lost or left workers forgotten after --worker-gc-timeout.")
    forgotten.add_metric([], status.workers_forgotten_total)
    heartbeats = _counter("dpex_worker_heartbeats", "Worker heartbeats answered since the dispatcher started.")
    heartbeats.add_metric([], status.worker_heartbeats_total)
    journal_errors = _counter("dpex_journal_write_errors", "Journal writes that failed (a full disk): each "
                              "change refused as an outage.")
    journal_errors.add_metric([], status.journal_write_errors_total)
    journal_failing = _gauge("dpex_journal_failing", "1 while the journal cannot be written: changes are refused "
                             "(UNAVAILABLE) until it can.")
    journal_failing.add_metric([], int(status.journal_failing))
    refused = _counter("dpex_refused_calls", "Calls refused, by reason: a wrong or missing token, a job's or "
                       "worker's key (another job's epochs or batches), a peer beyond loopback without a token.",
                       ["reason"])
    for reason, count in sorted(status.refused_calls_total.items()):
        refused.add_metric([reason], count)
    job_labels = ["job_id", "job_name"]
    planned = _counter("dpex_job_batches_planned", "Batches planned by the job's trainers.", job_labels)
    delivered = _counter("dpex_job_batches_delivered", "Batches trainers acknowledged.", job_labels)
    pending = _gauge("dpex_job_splits", "Live splits of the job by state.", [*job_labels, "state"])
    consumers = _gauge("dpex_job_consumers_active", "Consumers with an epoch in progress.", job_labels)
    for j in status.jobs:
        ids = [str(j.job_id), j.name]
        planned.add_metric(ids, j.batches_planned)
        delivered.add_metric(ids, j.batches_delivered)
        pending.add_metric([*ids, "assigned"], j.splits_assigned)
        pending.add_metric([*ids, "unassigned"], j.splits_unassigned)
        consumers.add_metric(ids, j.consumers_active)
    needed = _gauge("dpex_workers_needed", "Workers the trainers' measured rates call for (0: no trainer "
                    "reports a need): the target of a worker autoscaler.")
    needed.add_metric([], status.workers_needed)
    job_needed = _gauge("dpex_job_workers_needed", "The most workers a consumer of the job reported "
                        "needing in the last minute.", job_labels)
    for j in status.jobs:
        job_needed.add_metric([str(j.job_id), j.name], j.workers_needed)
    stage_s = _gauge("dpex_job_stage_seconds", "Mean seconds a batch of the job spent in each stage "
                     "(loader.stats().stages), over the last window of its consumer that waited most.",
                     [*job_labels, "stage"])
    job_wait = _gauge("dpex_job_wait_fraction", "The share of its last window that consumer spent waiting "
                      "for batches.", job_labels)
    verdicts = _gauge("dpex_job_bottleneck", "1 for the job's verdict (dpex.bottleneck: none, workers, storage, "
                      "network, trainer, straggler), as that consumer last measured.", [*job_labels, "bottleneck"])
    for j in status.jobs:
        if j.HasField("bottleneck"):
            ids = [str(j.job_id), j.name]
            for name, seconds in sorted(j.bottleneck.stages.items()):
                stage_s.add_metric([*ids, name], seconds)
            job_wait.add_metric(ids, j.bottleneck.wait_fraction)
            verdicts.add_metric([*ids, j.bottleneck.bottleneck], 1)
    heartbeat = _gauge("dpex_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat.",
                       ["worker_id", "address"])
    alive = [w for w in status.workers if w.state == "alive"]
    for w in alive:
        heartbeat.add_metric([w.worker_id, w.address], w.seconds_since_heartbeat)
    # Under names of the dispatcher's own: summed with the workers' own series, they would count twice.
    loads = load_metrics([([w.worker_id, w.address], w.load) for w in alive], "dpex_reported_",
                         ["worker_id", "address"])
    return [build_info(status.versions), workers, jobs, wanted, assigned, reassigned, collected, forgotten,
            heartbeats, journal_errors, journal_failing, refused, planned, delivered, pending,
            consumers, needed, job_needed, stage_s, job_wait, verdicts, heartbeat, *loads]
