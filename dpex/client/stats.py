"""What a loader measures on the trainer's side: how fast batches come and
how long the trainer waited for them; see :meth:`RemoteDataLoader.stats`."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

INPUT_BOUND_WAIT_FRACTION = 0.1  # waiting more than this share of the time: data is the bottleneck
MAX_SCALE_STEP = 4               # workers_needed is at most this many times the live workers


@dataclass(frozen=True)
class LoaderStats:
    """Trainer-side figures since the loader started (or the last reset).

    ``elapsed_s`` counts time inside epochs only (from the first ``next()``
    of an epoch to its last batch); ``wait_s`` is the part of it the trainer
    spent blocked in ``next()``. ``workers_needed`` is how many workers of
    the measured speed would keep the trainer from waiting, at most
    4 times the live workers (a step to take and measure again); ``advice``
    says why, in words. ``stages``: the mean seconds a batch spent in its
    batch process, by stage (``dataset`` and ``dataset_cpu``: the dataset's
    own code, wall and CPU, wall well above CPU meaning it waits on storage or
    the network; ``collate`` and ``collate_cpu``; ``dpex``: the rest, Dpex's
    part), over the batches whose process timed them; empty before any.
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


# A batch process's stages (dpex.v1.StageTimes, without the _s), as LoaderStats.stages names them.
STAGES = ("dataset", "dataset_cpu", "collate", "collate_cpu", "dpex")

NEED_WINDOW_S = 10.0  # the need reported to the dispatcher is measured over about this much time
FIRST_NEED_WINDOW_S = 3.0  # ... the first one over this much: a waiting trainer gets workers sooner


def _need(alive: int, elapsed: float, wait: float) -> int:
    """Workers of the measured speed that keep a trainer that waited ``wait``
    of ``elapsed`` seconds from waiting (the alive ones if it hardly waited).
    Workers deliver batches / elapsed; the trainer could take batches / computing."""
    computing = elapsed - wait  # the trainer's own time between batches
    if not (elapsed > 0 and wait / elapsed > INPUT_BOUND_WAIT_FRACTION and computing > 0):
        return alive
    return math.ceil(alive * elapsed / computing - 1e-9)


class StatsMeter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()
        self.workers_alive = 0
        self._window = [0.0, 0.0, 0]  # (elapsed, wait, batches) since the need was last measured
        self._recent = 0
        self.recent_wait = 0.0   # the share of the last window spent waiting (with recent_need)
        self.recent_rate = 0.0   # batches per second taken over the last window

    def _reset(self) -> None:
        self._stage_sums = dict.fromkeys(STAGES, 0.0)
        self._staged = 0  # batches whose stages were timed
        self._batches = self._bytes = 0
        self._elapsed = self._wait = 0.0
        self._last: tuple[object, float] | None = None  # (epoch's key, time of its last batch)

    def record(self, epoch: object, asked_at: float, nbytes: int) -> None:
        """A batch of ``epoch`` (a key, not the iterator: the meter must not
        keep it alive) returned from ``next()`` called at ``asked_at``."""
        now = time.monotonic()
        with self._lock:
            since = self._last[1] if self._last is not None and self._last[0] == epoch else asked_at
            self._last = (epoch, now)
            self._elapsed += now - since
            self._wait += now - asked_at
            self._window[0] += now - since
            self._window[1] += now - asked_at
            self._window[2] += 1
            self._batches += 1
            self._bytes += nbytes

    def stage(self, times: Any) -> None:
        """Adds a batch's stage times (a dpex.v1.StageTimes) from its batch process."""
        with self._lock:
            for name in STAGES:
                self._stage_sums[name] += getattr(times, f"{name}_s")
            self._staged += 1

    def recent(self) -> tuple[float, float]:
        """The share of time waiting and the batches per second over the last
        window, for the dispatcher; (0, 0) once the trainer has taken no batch
        for a window (it paused: it waits for nothing)."""
        with self._lock:
            if self._last is None or time.monotonic() - self._last[1] > NEED_WINDOW_S:
                return 0.0, 0.0
            return self.recent_wait, self.recent_rate

    def recent_need(self) -> int:
        """The trainer's need of workers over its last NEED_WINDOW_S of
        batches (the first time FIRST_NEED_WINDOW_S; 0 until that much was
        measured), for the dispatcher."""
        with self._lock:
            window = NEED_WINDOW_S if self._recent else FIRST_NEED_WINDOW_S
            if self._window[0] >= window and self.workers_alive > 0:
                alive = self.workers_alive
                elapsed, wait, batches = self._window
                self._recent = min(_need(alive, elapsed, wait), MAX_SCALE_STEP * alive)
                self.recent_wait, self.recent_rate = wait / elapsed, batches / elapsed
                self._window = [0.0, 0.0, 0]
            return self._recent

    def stats(self, reset: bool = False) -> LoaderStats:
        with self._lock:
            elapsed, wait, batches = self._elapsed, self._wait, self._batches
            computing = elapsed - wait  # the trainer's own time between batches
            fraction = wait / elapsed if elapsed > 0 else 0.0
            alive = self.workers_alive
            bound = fraction > INPUT_BOUND_WAIT_FRACTION
            cap = MAX_SCALE_STEP * max(1, alive)
            needed = _need(alive, elapsed, wait)
            if not bound:
                advice = f"not input-bound: the trainer waited {100 * fraction:.0f}% of the time"
            elif needed > cap:
                advice = (f"input-bound, and the trainer does almost no work between batches "
                          f"({computing:.2f}s of {elapsed:.2f}s): more workers help until the network or the "
                          f"trainer's receiving is the limit; try {cap} ({MAX_SCALE_STEP}x) and measure again")
                needed = cap
            else:
                advice = (f"input-bound: the trainer waited {100 * fraction:.0f}% of the time; {needed} workers "
                          f"of the measured speed would keep up")
            result = LoaderStats(batches=batches, bytes_received=self._bytes, elapsed_s=elapsed, wait_s=wait,
                                 batches_per_s=batches / elapsed if elapsed > 0 else 0.0,
                                 wait_fraction=fraction, input_bound=bound,
                                 workers_alive=alive, workers_needed=needed, advice=advice,
                                 stages={name: total / self._staged for name, total in self._stage_sums.items()}
                                 if self._staged else {})
            if reset:
                self._reset()
            return result
