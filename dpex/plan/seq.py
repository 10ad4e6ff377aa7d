"""Every seq arithmetic of an epoch, in one place.

A map-style epoch's batches are seqs 0 .. num_batches - 1, cut into splits of
``split_size`` consecutive seqs: split i holds ``split_seqs(first_seq(i), n)``.
An IterableDataset epoch of N streams has one split per stream: batch j of
stream k is seq ``j * N + k`` (:func:`stream_seq`; :func:`stream_of` goes
back), and a stream that ended after ``ends[k]`` batches has no later seq.
"""
from __future__ import annotations


def split_seqs(first_seq: int, count: int) -> range:
    """The seqs of a map-style split: ``first_seq`` and the ``count - 1`` after it."""
    return range(first_seq, first_seq + count)


def first_seq(index: int, split_size: int, num_streams: int = 0) -> int:
    """The first seq of split ``index`` (of a stream: the stream's number)."""
    return index if num_streams else index * split_size


def split_index(seq: int, split_size: int, num_streams: int = 0) -> int:
    """The index of the split that holds ``seq``."""
    return seq % num_streams if num_streams else seq // split_size


def stream_seq(stream: int, j: int, num_streams: int) -> int:
    """The seq of batch ``j`` of stream ``stream`` of ``num_streams``."""
    return j * num_streams + stream


def stream_of(seq: int, num_streams: int) -> tuple[int, int]:
    """(stream, batch of that stream) of ``seq``."""
    return seq % num_streams, seq // num_streams


def stream_seq_exists(seq: int, num_streams: int, ends: dict[int, int]) -> bool:
    """Whether ``seq`` can still come (its stream has not ended before it)."""
    stream, j = stream_of(seq, num_streams)
    end = ends.get(stream)
    return end is None or j < end


def streams_limit(num_streams: int, ends: dict[int, int]) -> int | None:
    """Seqs from here on do not exist; None while a stream may go on."""
    if len(ends) < num_streams:
        return None
    return max((stream_seq(k, j - 1, num_streams) + 1 for k, j in ends.items() if j > 0), default=0)


class Watermark:
    """Which seqs of an epoch have passed: every existing seq below ``low``,
    and those above it in ``ahead`` (when they pass out of order). A seq
    that cannot come counts as passed: past ``num_batches`` (map-style, when
    given) or past its stream's end (``ends``, stream -> its number of
    batches; the caller may share and fill the dict). The client's
    checkpoint progress and its fetch ledger each keep one."""

    def __init__(self, num_streams: int = 0, ends: dict[int, int] | None = None,
                 num_batches: int | None = None, done: list[tuple[int, int]] = ()) -> None:
        self.num_streams, self.num_batches = num_streams, num_batches
        self.ends = ends if ends is not None else {}
        self.low = 0
        self.ahead: set[int] = set()
        for start, end in done:  # passed ranges, ascending
            if start <= self.low:
                self.low = max(self.low, end)
            else:
                self.ahead.update(s for s in range(start, end) if self.exists(s))
        self.settle()

    def exists(self, seq: int) -> bool:
        """Whether ``seq`` is (or can still be) a batch of the epoch."""
        if self.num_streams:
            return stream_seq_exists(seq, self.num_streams, self.ends)
        return self.num_batches is None or seq < self.num_batches

    def limit(self) -> int | None:
        """Seqs from here on do not exist; None while that is not known."""
        return streams_limit(self.num_streams, self.ends) if self.num_streams else self.num_batches

    def passed(self, seq: int) -> bool:
        return (seq < self.low and self.exists(seq)) or seq in self.ahead

    def mark(self, seq: int) -> None:
        """``seq`` has passed."""
        if seq == self.low:
            self.low += 1
            self.settle()
        elif seq > self.low:
            self.ahead.add(seq)

    def settle(self) -> None:
        """Moves ``low`` past the seqs that passed or cannot come (call after ``ends`` grew)."""
        limit = self.limit()
        while (limit is None or self.low < limit) and (self.low in self.ahead or not self.exists(self.low)):
            self.ahead.discard(self.low)
            self.low += 1

    def seqs(self) -> set[int]:
        return {s for s in range(self.low) if self.exists(s)} | self.ahead

    def ranges(self) -> list[tuple[int, int]]:
        """The passed seqs as ascending [start, end) ranges (seqs that cannot come below ``low`` included)."""
        out = [(0, self.low)] if self.low else []
        for seq in sorted(self.ahead):
            if out and out[-1][1] == seq:
                out[-1] = (out[-1][0], seq + 1)
            else:
                out.append((seq, seq + 1))
        return out
