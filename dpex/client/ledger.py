"""Where each batch of one consumer's epoch stands: asked of a worker, to be
asked again, received and not yet given to the loop, delivered; and which to
ask for next. Pure bookkeeping: no I/O, no clock, no threads (the fetcher
does those), so each rule is tested on its own (tests/unit/test_ledger.py)."""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

from dpex.client.checkpoint import Progress
from dpex.plan.seq import Watermark

T = TypeVar("T")


class Ledger(Generic[T]):
    """The batches (seqs) of one epoch. Map-style: seqs 0 .. ``num_batches`` - 1.
    ``num_streams`` > 0 (an IterableDataset): batch j of stream k is seq j*N+k,
    and a stream's length is known once it ends (``progress.ends``).
    ``progress`` holds the seqs the loop was given; those of a checkpoint are
    never asked for again."""

    def __init__(self, num_batches: int, num_streams: int, progress: Progress) -> None:
        self.num_batches, self.num_streams = num_batches, num_streams
        self.progress = progress
        self.requested: dict[int, str] = {}  # seq -> the worker asked for it
        self.retry: set[int] = set()         # to ask again, of whoever owns it then
        self.received: dict[int, T] = {}     # seq -> item, not given to the loop yet
        self.resumed = progress.seqs()       # given before a checkpoint: not asked for
        # Received once (or given before): later copies are duplicates. Shares the progress's stream ends.
        self.delivered = Watermark(num_streams, progress.ends, None if num_streams else num_batches,
                                   done=progress.ranges())
        self.yielded = len(self.resumed)
        self.cursor = 0                      # next seq never requested
        self.next = 0                        # next seq to yield (ordered)
        self.again: int | None = None        # given before a checkpoint, fetched again, not given (dpex.client.gate)

    # ---- the epoch's seqs -----------------------------------------------------
    @property
    def low(self) -> int:
        """The lowest seq not received yet."""
        return self.delivered.low

    def limit(self) -> int | None:
        """Seqs from here on do not exist; None while a stream may go on."""
        return self.delivered.limit()

    def exists(self, seq: int) -> bool:
        return self.delivered.exists(seq)

    def total(self) -> int | None:
        """How many batches the epoch has; None while a stream may go on."""
        if not self.num_streams:
            return self.num_batches
        ends = self.progress.ends
        return sum(ends.values()) if len(ends) == self.num_streams else None

    @property
    def finished(self) -> bool:
        return self.yielded == self.total()

    def missing(self) -> list[int]:
        """The seqs not received yet (of a stream epoch: those asked for)."""
        if self.num_streams:
            return sorted(set(self.requested) | self.retry)
        return [s for s in range(self.num_batches) if not self.delivered.passed(s)]

    # ---- asking -----------------------------------------------------------------
    def asks(self, window: int, group: int, ordered: bool,
             route: Callable[[int], str | None]) -> dict[str, list[int]]:
        """The seqs to ask for now, by worker (``route(seq)``; None: nobody yet),
        marked requested. At most ``window`` outstanding, new ones in groups of
        ``group``; the next seq in order is always asked for, whatever the window:
        a window full of later batches must not block the one the loop waits for."""
        outstanding = len(self.requested) + len(self.received)
        urgent = self.next if ordered else -1
        room = window - outstanding >= group
        asks: dict[str, list[int]] = {}
        again = route(self.again) if self.again is not None and self.again not in self.requested else None
        if again is not None:
            asks[again] = [self.again]
            outstanding += 1
        for seq in sorted(self.retry):
            if self.delivered.passed(seq):  # came meanwhile (another request's answer): not asked again
                self.retry.discard(seq)
                continue
            address = route(seq)
            if address is not None and (outstanding < window or seq == urgent):
                self.retry.discard(seq)
                asks.setdefault(address, []).append(seq)
                outstanding += 1
        limit = self.limit()
        while (limit is None or self.cursor < limit) and ((room and outstanding < window) or self.cursor == urgent):
            # Passed over: not of the epoch, given before a checkpoint, or received unasked (answering
            # a request of the iterator this one replaced; its split may be gone, with no owner to ask).
            if not self.exists(self.cursor) or self.cursor in self.resumed or self.delivered.passed(self.cursor):
                self.cursor += 1
                continue
            address = route(self.cursor)
            if address is None:
                break
            asks.setdefault(address, []).append(self.cursor)
            self.cursor += 1
            outstanding += 1
        for address, seqs in asks.items():
            for seq in seqs:
                self.requested[seq] = address
        return asks

    def ask_again(self, seq: int, address: str) -> bool:
        """``seq``, asked of ``address``, is to be asked for again; False: it was
        not outstanding with ``address`` (received, or asked of another since)."""
        if self.requested.get(seq) != address:
            return False
        del self.requested[seq]
        self.retry.add(seq)
        return True

    def reroute(self, which: Callable[[int, str], bool]) -> list[tuple[int, str]]:
        """Asks again for the requested seqs ``which(seq, address)`` picks; returns them."""
        moved = [(seq, address) for seq, address in self.requested.items() if which(seq, address)]
        for seq, _ in moved:
            del self.requested[seq]
            self.retry.add(seq)
        return moved

    # ---- receiving and yielding -------------------------------------------------
    def is_new(self, seq: int) -> bool:
        """Not received before (else a duplicate, e.g. re-sent after a reconnect) and of this epoch."""
        return not self.delivered.passed(seq) and self.exists(seq)

    def receive(self, seq: int, item: T) -> None:
        self.requested.pop(seq, None)
        self.retry.discard(seq)
        self.delivered.mark(seq)
        self.received[seq] = item

    def end_stream(self, stream: int, end: int) -> None:
        """Stream ``stream`` has ``end`` batches: its later seqs are not asked for."""
        self.progress.end_stream(stream, end)
        for seq in [s for s in (*self.requested, *self.retry) if not self.exists(s)]:
            self.requested.pop(seq, None)
            self.retry.discard(seq)
        self.delivered.settle()

    def skip(self, seq: int) -> T | None:
        """Batch ``seq`` is not to be given (the loop skips it): never asked for, counted as given;
        its item if it was received (to drop)."""
        self.requested.pop(seq, None)
        self.retry.discard(seq)
        self.resumed.add(seq)  # as a checkpoint's: passed over
        self.delivered.mark(seq)
        self.yielded += 1
        return self.received.pop(seq, None)

    def pop_ready(self, ordered: bool) -> T | None:
        """The next received item to give to the loop, if it is here."""
        if ordered:
            limit = self.limit()
            while (not self.exists(self.next) or self.next in self.resumed) and (limit is None or self.next < limit):
                self.next += 1  # a finished stream's turn: torch skips exhausted workers too
            return self.received.pop(self.next, None)
        if self.received:
            return self.received.pop(next(iter(self.received)))
        return None

    def given(self, seq: int, ordered: bool) -> None:
        """The item of ``seq`` (from pop_ready) went to the loop."""
        self.yielded += 1
        if ordered:
            self.next = seq + 1
