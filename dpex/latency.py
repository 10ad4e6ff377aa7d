"""Latencies as histograms: one set of bucket bounds for every Dpex
histogram, so that counts kept in one process (a trainer's waits) add up
with another's (the dispatcher's, which exports them). Observing is a
lock and a bisect; the metrics endpoint reads the counts when scraped."""
from __future__ import annotations

import bisect
import threading
from typing import Callable, Hashable

# Upper bounds in seconds (a value equal to a bound falls in its bucket); the last bucket is +Inf.
BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Counts:
    """How many observations fell in each bucket (not cumulative; the last
    is +Inf), and their sum in seconds."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BOUNDS, seconds)] += 1
        self.sum_s += seconds

    def add(self, counts: list[int], sum_s: float) -> None:
        """Adds another's counts (of the same bounds; a shorter list: its first buckets)."""
        for i, n in enumerate(counts[:len(self.counts)]):
            self.counts[i] += n
        self.sum_s += sum_s

    @property
    def total(self) -> int:
        return sum(self.counts)


class Latencies:
    """:class:`Counts` by label values, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], Counts] = {}
        self._reported: dict[Hashable, tuple[list[int], float]] = {}  # reporter -> its last cumulative counts

    def observe(self, seconds: float, *labels: str) -> None:
        with self._lock:
            self._of(labels).observe(seconds)

    def add(self, counts: list[int], sum_s: float, *labels: str) -> None:
        with self._lock:
            self._of(labels).add(counts, sum_s)

    def counts(self, *labels: str) -> Counts:
        """A copy of one series' counts."""
        copy = Counts()
        with self._lock:
            mine = self._series.get(labels)
            if mine is not None:
                copy.add(mine.counts, mine.sum_s)
        return copy

    def grew(self, reporter: Hashable, counts: list[int], sum_s: float, *labels: str) -> None:
        """Adds what ``reporter``'s cumulative ``counts`` grew by since it last
        reported (all of them the first time, or if they shrank: it began
        again); a report received twice adds nothing."""
        with self._lock:
            last = self._reported.get(reporter)
            self._reported[reporter] = (list(counts), sum_s)
            if last is not None and len(last[0]) == len(counts) and all(a >= b for a, b in zip(counts, last[0])):
                counts, sum_s = [a - b for a, b in zip(counts, last[0])], sum_s - last[1]
            self._of(labels).add(counts, sum_s)

    def forget(self, keep: Callable[[tuple[str, ...]], bool], keep_reporter: Callable[[Hashable], bool]) -> None:
        """Drops the series whose labels ``keep`` refuses, and the reporters
        ``keep_reporter`` refuses (a collected job's)."""
        with self._lock:
            self._series = {k: v for k, v in self._series.items() if keep(k)}
            self._reported = {r: v for r, v in self._reported.items() if keep_reporter(r)}

    def series(self) -> list[tuple[tuple[str, ...], list[int], float]]:
        """(labels, counts, sum) of each series, copied."""
        with self._lock:
            return [(k, list(c.counts), c.sum_s) for k, c in self._series.items()]

    def _of(self, labels: tuple[str, ...]) -> Counts:
        counts = self._series.get(labels)
        if counts is None:
            counts = self._series[labels] = Counts()
        return counts

