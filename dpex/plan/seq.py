"""Seq arithmetic of an IterableDataset epoch: batch j of stream k of N is
seq ``j * N + k``; a stream that ended after ``ends[k]`` batches has no later seq."""
from __future__ import annotations


def stream_seq_exists(seq: int, num_streams: int, ends: dict[int, int]) -> bool:
    """Whether ``seq`` can still come (its stream has not ended before it)."""
    end = ends.get(seq % num_streams)
    return end is None or seq // num_streams < end


def streams_limit(num_streams: int, ends: dict[int, int]) -> int | None:
    """Seqs from here on do not exist; None while a stream may go on."""
    if len(ends) < num_streams:
        return None
    return max(((j - 1) * num_streams + k + 1 for k, j in ends.items() if j > 0), default=0)
