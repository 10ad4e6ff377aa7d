"""Which worker to ask for a batch: the owner the dispatcher last named for
its split (an IterableDataset epoch: for its stream), unless that worker's
stream just failed; then nobody until a backoff is over. The clock is an
argument, so the rules are tested without waiting (tests/unit/test_router.py)."""
from __future__ import annotations

import time
from typing import Callable

from dpex.plan import seq as seqs
from dpex.proto import dispatcher_pb2 as dpb

BACKOFF_S = 1.0  # a worker whose stream failed is not asked again before this


class Router:
    def __init__(self, num_streams: int = 0, backoff_s: float = BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._n = num_streams
        self._backoff_s, self._clock = backoff_s, clock
        self._owner: dict[int, str] = {}    # seq (a stream epoch: stream) -> worker address
        self._broken: dict[str, float] = {}  # address -> when it may be asked again
        self._failures: dict[str, int] = {}  # address -> failed streams to it
        self.workers_alive = -1             # as the dispatcher last said; -1: not yet

    def _key(self, seq: int) -> int:
        return seqs.stream_of(seq, self._n)[0] if self._n else seq

    def update(self, response: dpb.SyncConsumerResponse) -> None:
        """The dispatcher's owners replace what was known."""
        self.workers_alive = response.workers_alive
        self._owner = {}
        for o in response.owners:
            if self._n:
                self._owner[o.first_seq] = o.worker_address  # a stream
            for seq in seqs.split_seqs(o.first_seq, o.num_batches):
                self._owner[seq] = o.worker_address

    def owner(self, seq: int) -> str | None:
        return self._owner.get(self._key(seq))

    def route(self, seq: int) -> str | None:
        """The worker to ask for ``seq`` now; None: nobody (no owner known, or in backoff)."""
        address = self.owner(seq)
        if address is not None and address in self._broken:
            if self._clock() < self._broken[address]:
                return None
            del self._broken[address]
        return address

    def stream_failed(self, address: str) -> int:
        """The stream to ``address`` failed: not asked before the backoff. How often it failed."""
        failures = self._failures[address] = self._failures.get(address, 0) + 1
        self._broken[address] = self._clock() + self._backoff_s
        return failures

    def forget(self, seq: int, address: str) -> None:
        """``address`` said it does not have ``seq``: not asked until the dispatcher names an owner."""
        if self._owner.get(self._key(seq)) == address:
            del self._owner[self._key(seq)]
