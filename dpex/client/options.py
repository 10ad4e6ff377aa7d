"""LoaderOptions: a loader's own settings, the one source of their defaults,
checked before any RPC or process starts."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from dpex.errors import DpexConfigError
from dpex.address import check_address
from dpex.plan.even import rule_of
from dpex.wire.compression import check as check_compression


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise DpexConfigError(msg)


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


@dataclass(frozen=True)
class LoaderOptions:
    """What a RemoteDataLoader was asked for; defaults are the loader's."""
    address: str | None = None           # see dpex.launch.head; None: an embedded cluster
    batch_size: int | None = 1           # None: no auto-batching (each sampler element is a batch)
    drop_last: bool = False
    num_consumers: int = 1               # trainers (DDP ranks) sharing the job
    consumer_index: int = 0
    job_name: str | None = None          # None: a job of this loader's own (or the DDP run's)
    ordered: bool = True
    timeout_s: float | None = None       # longest wait for a batch; None: as long as it takes
    window: int | None = None            # batches requested ahead; None: 4 per live worker
    persistent_workers: bool = False
    pin_memory: bool = False
    pin_memory_device: str = ""          # "": the current accelerator
    num_workers: int = 1                 # streams of an IterableDataset; 0: one, as torch's main process
    prefetch_factor: int = 2             # as torch's: index batches asked per worker at iter() (0 workers: none)
    processes: int | None = None         # an embedded cluster's worker processes; None: one per core
    connect_timeout_s: float = 30.0      # how long an unreachable dispatcher is retried
    shared_memory: bool = True
    compression: str = ""                # "", "lz4" or "zstd"
    shuffle: bool | None = False
    seed: int | None = None              # a shuffle's generator's seed; None: torch's global RNG
    shard: bool = True                   # several consumers and no sampler: DistributedSampler's shares
    compact_plans: bool = True           # torch's samplers go as descriptions, not every index
    reproducible: bool = True            # a sample's random draws keyed by its place (dpex.seeding)
    auth_token: str | None = None        # None: $DPEX_AUTH_TOKEN
    tls_ca: str | None = None            # a PEM file; None: $DPEX_TLS_CA
    start_method: str | None = None      # an embedded cluster's processes; None: multiprocessing's
    share: bool = True                   # equal jobs' batches made once (dpex.worker.sharing)
    cache: str | None = None             # "memory" or "disk": samples kept on the workers (dpex.worker.samples)
    even_batches: bool | str | None = False  # several consumers: each the same number (dpex.plan.even)

    def __post_init__(self) -> None:
        if self.address is not None and self.address != "auto" and not str(self.address).startswith("ray://"):
            check_address(self.address)  # dpex://HOST:PORT or HOST:PORT
        _check(self.batch_size is None or _is_int(self.batch_size),
               f"batch_size should be a positive integer value, but got batch_size={self.batch_size!r}")
        _check(_is_int(self.num_consumers) and self.num_consumers >= 1,
               f"num_consumers must be an integer >= 1, got {self.num_consumers!r}")
        _check(_is_int(self.consumer_index) and 0 <= self.consumer_index < self.num_consumers,
               f"consumer_index must be in 0..{self.num_consumers - 1}, got {self.consumer_index!r}")
        _check(self.job_name is None or isinstance(self.job_name, str), "job_name must be a string or None")
        _check(self.timeout_s is None or (isinstance(self.timeout_s, numbers.Real) and self.timeout_s > 0),
               "timeout must be > 0 seconds, or None to wait as long as it takes")
        _check(self.window is None or (_is_int(self.window) and self.window >= 1), "window must be >= 1")
        _check(_is_int(self.num_workers) and self.num_workers >= 0, "num_workers must be >= 0")
        _check(_is_int(self.prefetch_factor) and self.prefetch_factor >= 1, "prefetch_factor must be >= 1")
        object.__setattr__(self, "persistent_workers", bool(self.persistent_workers))  # any truthy value, as torch
        _check(self.processes is None or (_is_int(self.processes) and self.processes >= 1),
               f"processes must be >= 1 or None (one per core), got {self.processes!r}")
        _check(isinstance(self.connect_timeout_s, numbers.Real) and self.connect_timeout_s >= 0,
               f"connect_timeout must be >= 0 seconds, got {self.connect_timeout_s!r}")
        _check(isinstance(self.pin_memory_device, str), "pin_memory_device must be a string")
        object.__setattr__(self, "compression", check_compression(self.compression))
        _check(self.seed is None or _is_int(self.seed), f"seed must be an integer or None, got {self.seed!r}")
        _check(self.cache in (None, "memory", "disk"), f"cache must be 'memory', 'disk' or None, got {self.cache!r}")
        try:  # kept as the rule's name: "shortest", "longest" (True) or None (torch's: False)
            object.__setattr__(self, "even_batches", rule_of(self.even_batches))
        except ValueError as e:
            raise DpexConfigError(str(e)) from None

    @property
    def first_contact_s(self) -> float:
        """How long the dispatcher (and its first worker) is waited for before
        it was ever reached: ``connect_timeout``, or ``timeout`` if shorter."""
        return self.connect_timeout_s if self.timeout_s is None else min(self.connect_timeout_s, self.timeout_s)
