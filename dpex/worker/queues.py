"""Each consumer's batches still to make on a worker, lowest key first and
the requested ones ahead of the rest, and its open Fetch streams; whose
turn it is goes round the jobs (dpex.worker.budget.Turns).

Pure bookkeeping: no locks, no clock; the scheduler calls it under its lock.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator

from dpex.worker.budget import Budget, Consumer, Turns
from dpex.wire.batchkey import Key


@dataclass
class Queue:
    """One consumer's batches still to make here, and its open streams."""
    todo: set[Key] = field(default_factory=set)
    pending: list[Key] = field(default_factory=list)  # heap over todo, lazily cleaned
    urgent: list[Key] = field(default_factory=list)   # heap of requested todo keys, lazily cleaned
    sinks: set = field(default_factory=set)           # Fetch streams that asked for its batches
    idle: bool = False                                # its streams all closed: nothing ahead

    def add(self, key: Key, urgent: bool) -> None:
        if key not in self.todo:
            self.todo.add(key)
            heapq.heappush(self.pending, key)
        if urgent:
            heapq.heappush(self.urgent, key)

    def head(self, heap: list[Key], ok: Callable[[Key], bool]) -> Key | None:
        """The lowest key of ``heap`` still to do and ``ok``; stale ones are dropped."""
        while heap:
            if heap[0] in self.todo and ok(heap[0]):
                return heap[0]
            heapq.heappop(heap)
        return None


class Queues:
    """The consumers with a queue here, grouped by job for the turns."""

    def __init__(self) -> None:
        self._of: dict[Consumer, Queue] = {}
        self._of_job: dict[int, set[Consumer]] = {}
        self._turns = Turns()

    def __iter__(self) -> Iterator[Consumer]:
        return iter(list(self._of))

    def __contains__(self, consumer: Consumer) -> bool:
        return consumer in self._of

    def items(self) -> list[tuple[Consumer, Queue]]:
        return list(self._of.items())

    def get(self, consumer: Consumer) -> Queue | None:
        return self._of.get(consumer)

    def of(self, consumer: Consumer) -> Queue:
        """The consumer's queue, made if it has none."""
        q = self._of.get(consumer)
        if q is None:
            q = self._of[consumer] = Queue()
            self._of_job.setdefault(consumer[0], set()).add(consumer)
            self._turns.add(consumer[0])
        return q

    def open(self, consumer: Consumer, sink) -> Queue:
        """A Fetch stream asked for the consumer's batches: it is not idle."""
        q = self.of(consumer)
        q.sinks.add(sink)
        q.idle = False
        return q

    def close(self, sink) -> list[Consumer]:
        """A Fetch stream closed: the consumers it left without one, now idle."""
        idle = []
        for consumer, q in self._of.items():
            if sink in q.sinks:
                q.sinks.discard(sink)
                if not q.sinks:
                    q.idle = True
                    idle.append(consumer)
        return idle

    def forget_if_unused(self, consumer: Consumer, budget: Budget) -> None:
        """Drops the consumer's queue, and its budget, if it has nothing to
        make, no open stream and nothing held (the caller knows it holds no split of it)."""
        q = self._of.get(consumer)
        if q is None or q.todo or q.sinks or budget.holding(consumer).batches:
            return
        budget.forget(consumer)
        del self._of[consumer]
        jobs = self._of_job.get(consumer[0], set())
        jobs.discard(consumer)
        if not jobs:
            self._of_job.pop(consumer[0], None)
            self._turns.remove(consumer[0])

    def active(self, budget: Budget) -> int:
        """Consumers sharing the buffer: those with work to make ahead or batches held."""
        return sum(1 for c, q in self._of.items() if (q.todo and not q.idle) or budget.holding(c).batches)

    def pick(self, choose: Callable[[Consumer, Queue], Key | None]) -> Key | None:
        """The lowest key ``choose`` gives of one job's consumers, from the
        first job, served longest ago, for which it gives one."""
        def of_job(job: int) -> Key | None:
            keys = [choose(c, self._of[c]) for c in self._of_job.get(job, ())]
            return min((k for k in keys if k is not None), default=None)
        return self._turns.pick(of_job)
