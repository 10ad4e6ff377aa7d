"""Frozen, validated configuration of the daemons. Units are in the names."""
from __future__ import annotations

from dataclasses import dataclass, field

from dpex.errors import DpexConfigError

MAX_MESSAGE_BYTES = 1 << 30  # what trainers accept: one batch must fit in one message
# A loader that called the dispatcher this recently holds its consumer (its long poll returns every
# second); a newcomer waits this long for a silent holder (a dead trainer) before it is refused.
CLAIM_HELD_S = 5.0


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise DpexConfigError(msg)


@dataclass(frozen=True)
class DispatcherConfig:
    host: str = "0.0.0.0"
    port: int = 7070                     # 0 picks a free port
    heartbeat_interval_s: float = 5.0    # the long poll of a heartbeat (it answers at once when there is work)
    heartbeat_timeout_s: float = 10.0    # a worker silent this long is lost
    split_size_batches: int = 4          # batches per split (the unit of assignment)
    work_dir: str | None = None          # the journal's directory; None: state in memory only
    consumer_timeout_s: float = 60.0     # a trainer silent this long mid-epoch is released
    auth_token: str | None = field(default=None, repr=False)  # None: no token checked
    auth_token_file: str | None = None   # tokens, one per line, read again on change (dpex.auth.Tokens)
    allow_unauthenticated: bool = False  # without a token: accept jobs from non-loopback peers too
    tls_cert_file: str | None = None     # PEM chain; with tls_key_file, serve TLS (None: plaintext)
    tls_key_file: str | None = None
    max_message_bytes: int = 256 << 20   # largest request taken (explicit plans come in 2 MB chunks)
    max_plan_batches: int = 10_000_000   # largest epoch plan taken, in batches
    metrics_port: int | None = None      # Prometheus endpoint; None: none, 0: a free port
    job_gc_timeout_s: float = 300.0      # a job without consumers this long is removed; 0: never
    worker_gc_timeout_s: float = 600.0   # a lost or left worker is forgotten after this; 0: never
    journal_compact_bytes: int = 256 << 10  # a log past this (and twice the snapshot) is snapshotted; 0: never
    min_workers: int = 1                 # the scaling policy's bounds (dpex.dispatcher.scaling);
    max_workers: int = 0                 # 0: the dispatcher does not say how many workers it wants
    scale_cooldown_s: float = 60.0       # no step down within this of the last change

    def __post_init__(self) -> None:
        _check(self.job_gc_timeout_s >= 0 and self.worker_gc_timeout_s >= 0,
               "job_gc_timeout_s and worker_gc_timeout_s must be >= 0 (0: never)")
        _check(0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}")
        _check(self.heartbeat_interval_s > 0, "heartbeat_interval_s must be > 0")
        _check(1 << 10 <= self.max_message_bytes <= MAX_MESSAGE_BYTES,
               f"max_message_bytes must be in 1 KiB..1 GiB, got {self.max_message_bytes}")
        _check(self.max_plan_batches >= 1, "max_plan_batches must be >= 1")
        _check(self.journal_compact_bytes >= 0, "journal_compact_bytes must be >= 0 (0: never)")
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "bad metrics_port")
        _check(self.heartbeat_timeout_s > self.heartbeat_interval_s,
               "heartbeat_timeout_s must exceed heartbeat_interval_s")
        _check(self.split_size_batches >= 1, "split_size_batches must be >= 1")
        _check(self.consumer_timeout_s > 1.0, "consumer_timeout_s must exceed 1 s (trainers sync every second)")
        _check(self.max_workers == 0 or 0 <= self.min_workers <= self.max_workers,
               f"need 0 <= min_workers <= max_workers, got {self.min_workers}..{self.max_workers}")
        _check(self.scale_cooldown_s >= 0, "scale_cooldown_s must be >= 0")


@dataclass(frozen=True)
class WorkerConfig:
    dispatcher: str                      # HOST:PORT of the dispatcher
    host: str = "0.0.0.0"                # bind address
    port: int = 0                        # 0 picks a free port
    advertise_host: str | None = None    # how trainers reach this worker; None: guessed
    processes: int = 2                   # batch-producing processes
    buffer_batches: int | None = None    # each consumer's batches made ahead of requests; None: max(8, processes)
    buffer_bytes: int = 1 << 30          # memory for batches made ahead, shared equally by consumers
    max_held_splits: int = 4             # splits taken from the dispatcher at once
    max_loaders: int = 4096              # open Fetch streams (a loader's, kept between epochs) served at once
    heartbeat_interval_s: float = 5.0    # as the dispatcher's (the same $DPEX_HEARTBEAT_INTERVAL)
    connect_timeout_s: float = 30.0      # how long to retry an unreachable dispatcher
    auth_token: str | None = field(default=None, repr=False)  # None: no token checked or sent
    auth_token_file: str | None = None   # tokens, one per line, read again on change (dpex.auth.Tokens)
    allow_unauthenticated: bool = False  # without a token: run jobs of a non-loopback dispatcher
    tls_cert_file: str | None = None     # PEM chain; with tls_key_file, serve TLS (None: plaintext)
    tls_key_file: str | None = None
    tls_ca_file: str | None = None       # CAs to verify a TLS dispatcher (None: plaintext to it)
    max_message_bytes: int = MAX_MESSAGE_BYTES  # largest batch frame sent; a bigger one is an error
    metrics_port: int | None = None      # Prometheus endpoint; None: none, 0: a free port
    shared_memory: bool = True           # frames via /dev/shm files; same-host trainers map them
    shm_min_bytes: int = 1 << 20         # smaller frames take the pipe and gRPC
    data_port: int | None = 0            # frames to other hosts on a TCP socket; 0: a free port, None: off
    drain_timeout_s: float = 2.0         # on SIGTERM, answer in-flight calls this long, then kill and exit
    data_paths: tuple[str, ...] = ()     # local data this node must have; a worker without one refuses to start
    in_turn: bool = False                # batch processes take a consumer's batches in turn, as torch's workers
    share_cache_bytes: int = 1 << 30     # batches kept for jobs of one definition (dpex.worker.sharing); 0: off
    sample_cache_bytes: int = 1 << 30    # samples of cache="memory" jobs in /dev/shm, then spilled to disk
    sample_disk_bytes: int = 8 << 30     # samples on disk (cache="disk", and spilled); the oldest go past it

    def __post_init__(self) -> None:
        _check(self.shm_min_bytes >= 0, "shm_min_bytes must be >= 0")
        _check(self.data_port is None or 0 <= self.data_port < 65536, "data_port must be in 0..65535 or None")
        _check(1 << 10 <= self.max_message_bytes <= MAX_MESSAGE_BYTES,
               f"max_message_bytes must be in 1 KiB..1 GiB, got {self.max_message_bytes}")
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536, "bad metrics_port")
        _check(":" in self.dispatcher, f"dispatcher must be HOST:PORT, got {self.dispatcher!r}")
        _check(0 <= self.port < 65536, f"port must be in 0..65535, got {self.port}")
        _check(self.processes >= 1, "processes must be >= 1")
        if self.buffer_batches is None:  # one consumer alone can keep every process busy
            object.__setattr__(self, "buffer_batches", max(8, self.processes))
        _check(self.buffer_batches >= 1, "buffer_batches must be >= 1")
        _check(self.buffer_bytes >= 1 << 20, "buffer_bytes must be >= 1 MiB")
        _check(self.max_held_splits >= 1, "max_held_splits must be >= 1")
        _check(self.max_loaders >= 1, f"max_loaders must be >= 1, got {self.max_loaders}")
        _check(self.heartbeat_interval_s > 0, "heartbeat_interval_s must be > 0")
        _check(self.connect_timeout_s >= 0, "connect_timeout_s must be >= 0")
        _check(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _check(self.share_cache_bytes >= 0, "share_cache_bytes must be >= 0 (0: nothing is shared)")
        _check(self.sample_cache_bytes >= 0 and self.sample_disk_bytes >= 0, "sample cache sizes must be >= 0")
