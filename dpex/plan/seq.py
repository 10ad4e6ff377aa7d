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
