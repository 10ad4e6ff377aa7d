"""What each consumer may hold ready on a worker, and whose turn it is.

A worker produces batches ahead of its trainers' requests. Each consumer (a
job's trainer rank) with work on the worker may hold up to ``max_batches``
of them (its own read-ahead depth, as tf.data service keeps a buffer per
task), and an equal share of the worker's ``max_bytes`` (the memory bound):
a slow, paused or departed consumer fills only its own share, and the
others keep producing ahead. When a newcomer finds the bytes taken by
someone else's over-share batches, the scheduler evicts those
(:meth:`Budget.over_share`); they are made again when asked for.

Production turns go round the jobs that have demand (:class:`Turns`), so one
job's long queue does not starve another's.

Pure bookkeeping: no locks, no clock; the scheduler calls it under its lock.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, TypeVar

Consumer = tuple[int, int]  # (job_id, consumer_index)
T = TypeVar("T")


@dataclass
class Holding:
    """One consumer's batches produced ahead of its requests."""
    ready: int = 0          # finished, waiting for a request
    ready_bytes: int = 0
    running: int = 0        # started ahead, not finished yet
    last_size: int = 0      # bytes of its last finished batch: the estimate for a running one

    @property
    def batches(self) -> int:
        return self.ready + self.running

    @property
    def bytes(self) -> int:
        return self.ready_bytes + self.running * self.last_size


class Budget:
    """Per-consumer shares of a worker's produce-ahead buffer."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        if max_batches < 1 or max_bytes < 1:
            raise ValueError("a budget needs at least one batch and one byte")
        self.max_batches, self.max_bytes = max_batches, max_bytes
        self._held: dict[Consumer, Holding] = {}

    def holding(self, consumer: Consumer) -> Holding:
        return self._held.get(consumer) or Holding()

    def _of(self, consumer: Consumer) -> Holding:
        return self._held.setdefault(consumer, Holding())

    # ---- transitions ---------------------------------------------------------
    def started(self, consumer: Consumer) -> None:
        """A batch was started ahead of any request."""
        self._of(consumer).running += 1

    def stopped(self, consumer: Consumer) -> None:
        """A batch started ahead finished, was dropped, or was asked for (the
        trainer's window holds it from then on)."""
        h = self._of(consumer)
        h.running = max(0, h.running - 1)
        self._tidy(consumer)

    def readied(self, consumer: Consumer, nbytes: int) -> None:
        """A finished batch waits for a request."""
        h = self._of(consumer)
        h.ready += 1
        h.ready_bytes += nbytes
        h.last_size = nbytes

    def taken(self, consumer: Consumer, nbytes: int) -> None:
        """A waiting batch was sent, evicted or released."""
        h = self._of(consumer)
        h.ready = max(0, h.ready - 1)
        h.ready_bytes = max(0, h.ready_bytes - nbytes)
        self._tidy(consumer)

    def sized(self, consumer: Consumer, nbytes: int) -> None:
        """A batch of the consumer's was this big (sent straight to a request)."""
        self._of(consumer).last_size = nbytes

    def forget(self, consumer: Consumer) -> None:
        self._held.pop(consumer, None)

    def _tidy(self, consumer: Consumer) -> None:
        h = self._held.get(consumer)
        if h is not None and h.batches == 0:
            h.ready_bytes = 0  # last_size is kept: the next batch's estimate

    # ---- questions -------------------------------------------------------------
    def share(self, active: int) -> tuple[int, int]:
        """(batches, bytes) one of ``active`` consumers may hold ahead: its own
        depth, and an equal part of the memory."""
        return self.max_batches, max(1, self.max_bytes // max(1, active))

    def total_bytes(self) -> int:
        return sum(h.bytes for h in self._held.values())

    def room(self, consumer: Consumer, active: int) -> bool:
        """Whether the consumer may start one more batch ahead within its share."""
        h = self.holding(consumer)
        batches, nbytes = self.share(active)
        return h.batches < batches and (h.batches == 0 or h.bytes + h.last_size <= nbytes)

    def fits(self, consumer: Consumer) -> bool:
        """Whether one more batch of the consumer's fits in the worker's memory bound."""
        total = self.total_bytes()
        return total == 0 or total + self.holding(consumer).last_size <= self.max_bytes

    def over_share(self, active: int, consumers: Iterable[Consumer]) -> Consumer | None:
        """Of ``consumers``, the one with ready batches most over its share, if any."""
        batches, nbytes = self.share(active)
        worst, excess = None, 0.0
        for c in consumers:
            h = self.holding(c)
            if not h.ready:
                continue
            over = max((h.batches - batches) / batches, (h.bytes - nbytes) / nbytes)
            if over > excess:
                worst, excess = c, over
        return worst


class Turns:
    """Round-robin over jobs: the next job with demand is the one served
    longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def pick(self, choose: Callable[[int], T | None]) -> T | None:
        """``choose(job)`` of the first job, longest unserved first, for which
        it is not None; that job goes to the back of the line."""
        for job in list(self._order):
            chosen = choose(job)
            if chosen is not None:
                self._order.move_to_end(job)
                return chosen
        return None

    def add(self, job: int) -> None:
        if job not in self._order:
            self._order[job] = None

    def remove(self, job: int) -> None:
        self._order.pop(job, None)
