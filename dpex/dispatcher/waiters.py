"""Long polls that wake only for what they wait for.

A worker's heartbeat waits for splits to take or to drop; a trainer's sync
waits for the owners of its plan to change. With a thousand workers polling,
waking every poll at every update would cost O(polls) per update, each woken
heartbeat choosing splits again. Instead the state machine says what its
updates touched (``DispatcherState.take_changes``) and :meth:`Waiters.wake`
wakes those polls only: the workers whose splits changed, the consumers whose
owners changed, and, when splits became available, as many of the workers
waiting for splits as there are new splits (the longest waiting first).

All methods are called with the service's lock held.
"""
from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

from dpex.dispatcher.state import Changes


# Long polls held at once (server.py gives the gRPC server threads for as many
# and more); past it a poll is answered at once and the worker paces itself.
MAX_POLLS = 2000


class Waiters:
    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._workers: dict[str, set[threading.Condition]] = {}
        self._hungry: OrderedDict[threading.Condition, None] = OrderedDict()  # wanting splits, oldest first
        self._consumers: dict[tuple[int, int], set[threading.Condition]] = {}
        self.polling = 0  # polls waiting now

    @property
    def full(self) -> bool:
        return self.polling >= MAX_POLLS

    def worker(self, worker_id: str, wants_splits: bool, timeout: float, context=None) -> None:
        """Waits (at most ``timeout``) until the worker's splits change or,
        if it ``wants_splits``, splits become available."""
        self._poll(self._workers, worker_id, wants_splits, timeout, context)

    def consumer(self, key: tuple[int, int], timeout: float, context=None) -> None:
        """Waits (at most ``timeout``) until the owners of the consumer's plan change."""
        self._poll(self._consumers, key, False, timeout, context)

    def wake(self, changes: Changes) -> None:
        for worker_id in changes.workers:
            for cond in self._workers.get(worker_id, ()):
                cond.notify()
        for key in changes.consumers:
            for cond in self._consumers.get(key, ()):
                cond.notify()
        for cond in list(itertools.islice(self._hungry, changes.splits_freed)):
            cond.notify()
            self._hungry.move_to_end(cond)  # woken: the next new split goes to another first

    def wake_all(self) -> None:
        for polls in (*self._workers.values(), *self._consumers.values()):
            for cond in polls:
                cond.notify()

    def _poll(self, table: dict, key, hungry: bool, timeout: float, context) -> None:
        cond = threading.Condition(self._lock)
        table.setdefault(key, set()).add(cond)
        if hungry:
            self._hungry[cond] = None
        # A cancelled call (the worker cut its poll short, a trainer left)
        # frees its thread at once rather than at the timeout.
        if context is not None:
            context.add_callback(lambda: self._notify(cond))
        self.polling += 1
        try:
            cond.wait(timeout)
        finally:
            self.polling -= 1
            table[key].discard(cond)
            if not table[key]:
                del table[key]
            self._hungry.pop(cond, None)

    def _notify(self, cond: threading.Condition) -> None:
        with self._lock:
            cond.notify()
