"""Long polls that wake only for what they wait for.

A worker's heartbeat waits for splits to take or to drop; a trainer's sync
waits for the owners of its plan to change. With a thousand workers polling,
waking every poll at every update would cost O(polls) per update, each woken
heartbeat choosing splits again. Instead the state machine says what its
updates touched (``DispatcherState.take_changes``) and :meth:`Waiters.wake`
wakes those polls only: the workers whose splits changed, the consumers whose
owners changed, and, when splits became available, as many of the workers
waiting for splits as there are new splits (the longest waiting first).

A poll is a future on the gRPC server's event loop, not a thread: a fleet's
long polls cost memory, not threads. Registering, unregistering and waking
happen with the service's lock held, from any thread (the loop, the thread
pool of the short calls, the reaper); waiting happens on the loop.
"""
from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict

from dpex.dispatcher.state import Changes


# Long polls held at once; past it a poll is answered at once and the worker
# paces itself (an interval between heartbeats).
MAX_POLLS = 20_000


class Poll:
    """One long poll: done when woken or timed out."""

    __slots__ = ("loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future = loop.create_future()

    def wake(self) -> None:
        """From any thread."""
        try:
            here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            here = False
        if here:
            self._set()
        else:
            self.loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        if not self.future.done():
            self.future.set_result(None)

    async def wait(self, timeout: float) -> None:
        timer = self.loop.call_later(timeout, self._set)
        try:
            await self.future
        finally:
            timer.cancel()


class Waiters:
    def __init__(self) -> None:
        self._workers: dict[str, set[Poll]] = {}
        self._hungry: OrderedDict[Poll, None] = OrderedDict()  # wanting splits, oldest first
        self._consumers: dict[tuple[int, int], set[Poll]] = {}
        self._tables: dict[Poll, tuple[dict, object]] = {}
        # worker -> its splits delivered in full: it drops them with its next heartbeat's
        # answer, and they do not make a waiting heartbeat answer early (Changes.settled).
        self.settled: dict[str, set[int]] = {}

    @property
    def polling(self) -> int:
        """Polls waiting now."""
        return len(self._tables)

    @property
    def full(self) -> bool:
        return self.polling >= MAX_POLLS

    def worker(self, worker_id: str, wants_splits: bool) -> Poll:
        """A poll (to :meth:`Poll.wait` on, then :meth:`done`) woken when the
        worker's splits change or, if it ``wants_splits``, splits become available."""
        poll = self._add(self._workers, worker_id)
        if wants_splits:
            self._hungry[poll] = None
        return poll

    def consumer(self, key: tuple[int, int]) -> Poll:
        """A poll woken when the owners of the consumer's plan change."""
        return self._add(self._consumers, key)

    def done(self, poll: Poll) -> None:
        table, key = self._tables.pop(poll)
        table[key].discard(poll)
        if not table[key]:
            del table[key]
        self._hungry.pop(poll, None)

    def wake(self, changes: Changes) -> None:
        for worker_id, split_ids in changes.settled.items():
            self.settled.setdefault(worker_id, set()).update(split_ids)
        for worker_id in changes.workers:
            for poll in self._workers.get(worker_id, ()):
                poll.wake()
        for key in changes.consumers:
            for poll in self._consumers.get(key, ()):
                poll.wake()
        for poll in list(itertools.islice(self._hungry, changes.splits_freed)):
            poll.wake()
            self._hungry.move_to_end(poll)  # woken: the next new split goes to another first

    def wake_consumers(self, keys) -> None:
        """Wakes the polls of these consumers ((job, consumer) pairs)."""
        for key in keys:
            for poll in self._consumers.get(key, ()):
                poll.wake()

    def told(self, worker_id: str, held: set[int], released: list[int]) -> None:
        """The worker that holds ``held`` was told to drop ``released``: it
        no longer needs a word of those, nor of settled splits it does not hold."""
        settled = self.settled.get(worker_id)
        if settled is not None:
            settled &= held
            settled -= set(released)
            if not settled:
                del self.settled[worker_id]

    def forget_worker(self, worker_id: str) -> None:
        """A worker lost or gone: no settled split of it to tell."""
        self.settled.pop(worker_id, None)

    def wake_all(self) -> None:
        for poll in list(self._tables):
            poll.wake()

    def _add(self, table: dict, key) -> Poll:
        poll = Poll(asyncio.get_running_loop())
        table.setdefault(key, set()).add(poll)
        self._tables[poll] = (table, key)
        return poll
