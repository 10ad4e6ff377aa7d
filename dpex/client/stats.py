"""What a loader measures on the trainer's side: how fast batches come, how
long the trainer waited for them, where a batch's time went (in its batch
process, on the wire, on the trainer) and, from those, the verdict and the
what-if of dpex.bottleneck; see :meth:`RemoteDataLoader.stats`."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dpex import bottleneck
from dpex.bottleneck import INPUT_BOUND_WAIT_FRACTION, MAX_SCALE_STEP, Figures
from dpex.latency import Latencies
from dpex.proto.dispatcher_pb2 import Verdict

__all__ = ["INPUT_BOUND_WAIT_FRACTION", "MAX_SCALE_STEP", "LoaderStats", "StatsMeter"]


@dataclass(frozen=True)
class LoaderStats:
    """Trainer-side figures since the loader started (or the last reset).

    Attributes:
        batches: batches given to the loop.
        bytes_received: their frames' bytes.
        elapsed_s: time inside epochs only (from an epoch's first ``next()`` to its last batch).
        wait_s: the part of it the trainer spent blocked in ``next()``.
        batches_per_s: batches over ``elapsed_s``.
        wait_fraction: ``wait_s`` over ``elapsed_s``.
        input_bound: waiting more than 10 % of the time: data is the limit.
        workers_alive: the job's live workers.
        workers_needed: workers of the measured speed that would keep the trainer from waiting, at most
            4 times the live ones (a step to take and measure again).
        advice: why, in words.
        stages: the mean seconds a batch spent in each stage: in its batch process (``dataset`` and
            ``dataset_cpu``: the dataset's own code, wall and CPU, wall well above CPU meaning it waits on
            storage or the network, unless ``dataset_cpu_wait``, the part it waited for a core, says the
            host's CPUs are oversubscribed; ``collate``, ``collate_cpu``, ``collate_cpu_wait``; ``dpex``:
            Dpex's part); on the trainer ``receive`` (off a worker's data socket), ``decode``, ``pin``. A
            stage appears once measured.
        bottleneck: the verdict: ``none``, ``workers``, ``storage``, ``network``, ``trainer`` or
            ``straggler`` (dpex.bottleneck.VERDICTS).
        bottleneck_reason: the verdict's reason in words.
        batches_dropped: ``even_batches="shortest"``: this consumer's own batches past the fewest, not given.
        batches_repeated: ``even_batches="longest"``: its first batch given again once its own ran out.
        figures: the measures :meth:`predict` models from.
    """
    batches: int
    bytes_received: int
    elapsed_s: float
    wait_s: float
    batches_per_s: float
    wait_fraction: float
    input_bound: bool
    workers_alive: int
    workers_needed: int
    advice: str = ""
    stages: dict[str, float] = field(default_factory=dict)
    bottleneck: str = "none"
    bottleneck_reason: str = ""
    batches_dropped: int = 0   # even_batches="shortest": a consumer's own batches past the fewest, not given
    batches_repeated: int = 0  # even_batches="longest": its first batch given again once its own ran out
    figures: Figures | None = field(default=None, repr=False, compare=False)

    def predict(self, workers: int | None = None, processes: int | None = None) -> float:
        """The batches/s the trainer would take (dpex.bottleneck.predict: the autoscaler's model).

        Args:
            workers: workers like the live ones; None: as many as live.
            processes: batch processes each (the lever where they wait on storage); None: as now.
        Returns:
            Batches per second (0.0 before anything was measured).
        Raises:
            ValueError: ``processes`` where the workers' processes are not known (an IterableDataset's)."""
        return bottleneck.predict(self.figures, workers, processes) if self.figures is not None else 0.0


# A batch process's stages (dpex.v1.StageTimes, without the _s), as LoaderStats.stages names them.
STAGES = ("dataset", "dataset_cpu", "dataset_cpu_wait", "collate", "collate_cpu", "collate_cpu_wait", "dpex")
# The trainer's own: reading a frame off a data socket, decoding it (a same-host worker's file mapped), pinning.
TRAINER_STAGES = ("receive", "decode", "pin")

NEED_WINDOW_S = 10.0  # the need reported to the dispatcher is measured over about this much time
FIRST_NEED_WINDOW_S = 3.0  # ... the first one over this much: a waiting trainer gets workers sooner


class _Sums:
    """What was measured over a span of batches (since the loader started or
    was reset, or over the dispatcher's window): the figures dpex.bottleneck reads."""

    def __init__(self) -> None:
        self.batches = self.nbytes = 0
        self.elapsed = self.wait = 0.0
        self.stages = dict.fromkeys(STAGES + TRAINER_STAGES, 0.0)
        self.staged = 0  # batches whose batch-process stages were timed
        self.received = 0  # batches received (their trainer stages timed)
        self.timed: set[str] = set()  # the trainer stages measured at least once
        self.by_worker: dict[str, list[float]] = {}  # address -> [seconds its batch processes took, batches]
        self.processes: dict[str, int] = {}  # address -> its batch processes, as its frames say

    def taken(self, elapsed: float, wait: float, nbytes: int) -> None:
        self.elapsed += elapsed
        self.wait += wait
        self.batches += 1
        self.nbytes += nbytes

    def received_one(self, address: str, times: Any | None, receive_s: float, decode_s: float,
                     processes: int) -> None:
        self.received += 1
        if processes:
            self.processes[address] = processes
        self.stages["receive"] += receive_s
        self.stages["decode"] += decode_s
        self.timed.update(("decode",) + (("receive",) if receive_s else ()))
        if times is not None:
            for name in STAGES:
                self.stages[name] += getattr(times, f"{name}_s")
            self.staged += 1
            made = self.by_worker.setdefault(address, [0.0, 0])
            # Its own speed: less the time its processes waited for a core (a crowded host, the
            # workers' shared lot on one, is said by the "workers" verdict, not blamed on one of them).
            made[0] += max(0.0, times.dataset_s + times.collate_s + times.dpex_s - times.dataset_cpu_wait_s
                           - times.collate_cpu_wait_s)
            made[1] += 1

    def pinned(self, seconds: float) -> None:
        self.stages["pin"] += seconds
        self.timed.add("pin")

    def figures(self, workers_alive: int) -> Figures:
        stages = {name: self.stages[name] / self.staged for name in STAGES} if self.staged else {}
        stages.update((name, self.stages[name] / self.received) for name in TRAINER_STAGES
                      if name in self.timed and self.received)
        return Figures(self.batches, self.elapsed, self.wait, workers_alive, stages,
                       {a: t / n for a, (t, n) in self.by_worker.items() if n},
                       sum(self.processes.values()) / len(self.processes) if self.processes else 0.0)


class StatsMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = _Sums()   # since the loader started or stats(reset=True)
        self._window = _Sums()  # since the need was last measured
        self._last: tuple[object, float] | None = None  # (epoch's key, time of its last batch)
        self.workers_alive = 0
        self._recent = 0
        self._verdict: Verdict | None = None  # the last window's (its wait share and rate too), for the dispatcher
        self._evened = [0, 0]  # batches dropped and repeated by even_batches, since the start or reset
        self.waits = Latencies()  # each batch's wait in next(), since the loader began (the syncs report them)

    def record(self, epoch: object, asked_at: float, nbytes: int) -> None:
        """A batch of ``epoch`` (a key, not the iterator: the meter must not
        keep it alive) returned from ``next()`` called at ``asked_at``."""
        now = time.monotonic()
        with self._lock:
            since = self._last[1] if self._last is not None and self._last[0] == epoch else asked_at
            self._last = (epoch, now)
            for sums in (self._total, self._window):
                sums.taken(now - since, now - asked_at, nbytes)
        self.waits.observe(now - asked_at)

    def received(self, address: str, times: Any | None, receive_s: float, decode_s: float,
                 processes: int = 0) -> None:
        """A batch received from worker ``address``: its batch process's stage
        times (a dpex.v1.StageTimes; None: not timed), the seconds its frame
        took to read off the data socket (0: it did not come on one) and to
        decode, and the worker's batch processes (0: not said)."""
        with self._lock:
            for sums in (self._total, self._window):
                sums.received_one(address, times, receive_s, decode_s, processes)

    def evened(self, dropped: int = 0, repeated: int = 0) -> None:
        """even_batches dropped or repeated batches (dpex.client.gate)."""
        with self._lock:
            self._evened[0] += dropped
            self._evened[1] += repeated

    def pinned(self, seconds: float) -> None:
        """A batch was pinned in ``seconds``."""
        with self._lock:
            for sums in (self._total, self._window):
                sums.pinned(seconds)

    def _stale(self) -> bool:
        """No batch taken for a window: the trainer paused, it waits for nothing."""
        return self._last is None or time.monotonic() - self._last[1] > NEED_WINDOW_S

    def recent(self) -> tuple[float, float]:
        """The share of time waiting and the batches per second over the last
        window, for the dispatcher; (0, 0) once the trainer has taken no batch
        for a window (it paused: it waits for nothing)."""
        with self._lock:
            v = None if self._stale() else self._verdict
            return (0.0, 0.0) if v is None else (v.wait_fraction, v.batches_per_s)

    def recent_verdict(self) -> Verdict | None:
        """Where the time went over the last window (a dpex.v1.Verdict), for the
        dispatcher; None before a window was measured or once the trainer paused."""
        with self._lock:
            return None if self._stale() else self._verdict

    def recent_need(self) -> int:
        """The trainer's need of workers over its last NEED_WINDOW_S of
        batches (the first time FIRST_NEED_WINDOW_S; 0 until that much was
        measured), for the dispatcher; the window's verdict with it."""
        with self._lock:
            window = NEED_WINDOW_S if self._recent else FIRST_NEED_WINDOW_S
            if self._window.elapsed >= window and self.workers_alive > 0:
                figures = self._window.figures(self.workers_alive)
                self._recent = bottleneck.need(figures)
                word, reason = bottleneck.verdict(figures)
                self._verdict = Verdict(bottleneck=word, reason=reason, stages=figures.stages,
                                        wait_fraction=figures.wait_fraction, batches_per_s=figures.rate,
                                        workers_alive=figures.workers_alive, processes=figures.processes)
                self._window = _Sums()
            return self._recent

    def stats(self, reset: bool = False) -> LoaderStats:
        with self._lock:
            figures, nbytes = self._total.figures(self.workers_alive), self._total.nbytes
            dropped, repeated = self._evened
            if reset:
                self._evened = [0, 0]
                self._total = _Sums()
                self._last = None
        fraction, computing = figures.wait_fraction, figures.elapsed_s - figures.wait_s
        needed, step = bottleneck.need(figures, capped=False), bottleneck.need(figures)
        if not figures.input_bound:
            advice = f"not input-bound: the trainer waited {100 * fraction:.0f}% of the time"
        elif needed > step:
            advice = (f"input-bound, and the trainer does almost no work between batches "
                      f"({computing:.2f}s of {figures.elapsed_s:.2f}s): more workers help until the network or the "
                      f"trainer's receiving is the limit; try {step} ({MAX_SCALE_STEP}x) and measure again")
            needed = step
        else:
            advice = (f"input-bound: the trainer waited {100 * fraction:.0f}% of the time; {needed} workers "
                      f"of the measured speed would keep up")
        word, reason = bottleneck.verdict(figures)
        return LoaderStats(batches=figures.batches, bytes_received=nbytes,
                           elapsed_s=figures.elapsed_s, wait_s=figures.wait_s, batches_per_s=figures.rate,
                           wait_fraction=fraction, input_bound=figures.input_bound,
                           workers_alive=figures.workers_alive, workers_needed=needed, advice=advice,
                           stages=figures.stages, bottleneck=word, bottleneck_reason=reason,
                           batches_dropped=dropped, batches_repeated=repeated, figures=figures)
