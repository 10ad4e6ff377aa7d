"""What a worker counts about its own work: batches and bytes produced and
sent, and how busy its processes are. The heartbeat reports it to the
dispatcher (for ``dpex status``) and the metrics endpoint exports it."""
from __future__ import annotations

import collections
import threading
import time

from dpex.latency import Latencies

from dpex.proto import dispatcher_pb2 as dpb


class Meter:
    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._lock = threading.Lock()
        self.batches_produced = 0
        self.bytes_produced = 0
        self.batches_sent = 0
        self.bytes_sent = 0
        self.queued_s = 0.0           # seconds sent batches waited, made, for their request
        self.send_s = 0.0             # seconds sent batches took from due to handed to the network
        self.fetch_streams = 0
        self.busy_s = 0.0             # process-seconds spent producing batches
        self._running = 0
        self._since = time.monotonic()
        self._window = (self._since, 0.0)  # (time, busy_s) at the last window() call
        self.busy_fraction = 0.0      # as of the last window() call
        self.produce_seconds = Latencies()  # each batch, from its start to made (by the pool or a sharer)
        self.errors: collections.Counter[str] = collections.Counter()  # batches failed, by errors.kind_of

    def _integrate(self, now: float) -> None:
        self.busy_s += min(self._running, self.processes) * (now - self._since)
        self._since = now

    def running(self, count: int) -> None:
        """The number of batches being produced changed to ``count``."""
        with self._lock:
            self._integrate(time.monotonic())
            self._running = count

    def produced(self, nbytes: int, seconds: float, error: str | None = None) -> None:
        """A batch was made in ``seconds`` (``error``: its frame is that kind of error)."""
        self.produce_seconds.observe(seconds)
        with self._lock:
            self.batches_produced += 1
            self.bytes_produced += nbytes
            if error is not None:
                self.errors[error] += 1

    def sent(self, nbytes: int) -> None:
        with self._lock:
            self.batches_sent += 1
            self.bytes_sent += nbytes

    def queued(self, seconds: float) -> None:
        """A made batch was asked for after waiting ``seconds``."""
        with self._lock:
            self.queued_s += seconds

    def sending(self, seconds: float) -> None:
        """A batch took ``seconds`` from due to handed to the network."""
        with self._lock:
            self.send_s += seconds

    def stream(self, delta: int) -> None:
        with self._lock:
            self.fetch_streams += delta

    def busy_seconds(self) -> float:
        with self._lock:
            self._integrate(time.monotonic())
            return self.busy_s

    def window(self, min_s: float = 0.5) -> float:
        """The busy fraction of the processes over the last window of at
        least ``min_s`` (heartbeats can follow each other within milliseconds)."""
        with self._lock:
            now = time.monotonic()
            self._integrate(now)
            then, busy_then = self._window
            if now - then >= min_s:
                self._window = (now, self.busy_s)
                self.busy_fraction = (self.busy_s - busy_then) / ((now - then) * self.processes)
            return self.busy_fraction

    def load(self, buffer_batches: int, running_batches: int) -> dpb.WorkerLoad:
        """The counters, with the busy fraction of the last window()."""
        with self._lock:
            return dpb.WorkerLoad(processes=self.processes, busy_fraction=self.busy_fraction,
                                  buffer_batches=buffer_batches, running_batches=running_batches,
                                  batches_produced=self.batches_produced, bytes_produced=self.bytes_produced,
                                  batches_sent=self.batches_sent, bytes_sent=self.bytes_sent,
                                  fetch_streams=self.fetch_streams, queued_s=self.queued_s, send_s=self.send_s)
