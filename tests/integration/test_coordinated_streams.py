"""Coordinated reads for an IterableDataset (issue 59): RemoteDataLoader(lengths=fn) buckets on the fly in
the streams (dpex.BucketedIterable), and gives, rank by rank, the batches torch's DataLoader gives with the
same wrapper, bitwise (random draws too); every sample once across the ranks; each step's batches alike
across the ranks; a stream resumed mid-window goes on bitwise as if not stopped."""
import os
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import dpex
from dpex.testing import test_cluster
from dpex.testing.datasets import StatefulTokenStream, TokenStream, heavy_tailed_lengths, pad_tokens

N, B, WORLD, STREAMS = 480, 4, 2, 2
LENGTHS = heavy_tailed_lengths(N, seed=3)


def length(sample):
    return len(sample["tokens"])


def as_lists(batches):
    return [(b["i"].tolist(), b["tokens"].numpy().tobytes(), b["noise"].numpy().tobytes()) for b in batches]


def torchs(rank, window_batches=8):
    """Rank ``rank``'s batches from torch's DataLoader given the same wrapper (its workers see RANK as
    torchrun's do)."""
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(WORLD)
    try:
        data = dpex.BucketedIterable(TokenStream(LENGTHS), length, B, seed=5, window_batches=window_batches)
        return as_lists(DataLoader(data, batch_size=B, num_workers=STREAMS, collate_fn=pad_tokens,
                                   generator=torch.Generator().manual_seed(11)))
    finally:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]


def test_ranks_get_torchs_batches_bucketed_on_the_fly():
    got = {}
    with test_cluster(num_workers=2) as c:
        def rank(r):
            data = dpex.BucketedIterable(TokenStream(LENGTHS), length, B, seed=5, window_batches=8)
            with dpex.RemoteDataLoader(c.address, data, batch_size=B, num_workers=STREAMS, collate_fn=pad_tokens,
                                       num_consumers=WORLD, consumer_index=r, job_name="bucketed streams",
                                       generator=torch.Generator().manual_seed(11), timeout=60) as dl:
                got[r] = as_lists(dl)
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(WORLD)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    for r in range(WORLD):
        assert got[r] == torchs(r)  # indices, tokens and the global generator's draws, bitwise
    ranks = [[i for i, _, _ in got[r]] for r in range(WORLD)]
    assert sorted(i for r in ranks for b in r for i in b) == list(range(N))  # every sample once
    lengths = np.array(LENGTHS)
    steps = min(len(r) for r in ranks)
    across = [np.ptp(np.concatenate([lengths[ranks[r][s]] for r in range(WORLD)])) for s in range(steps)]
    # Without bucketing: the same streams' batches in their own order.
    plain = [as_lists(DataLoader(TokenStream(LENGTHS), batch_size=B, num_workers=0, collate_fn=pad_tokens))]
    unbucketed = [np.ptp(lengths[np.array(b[0])]) for b in plain[0][:steps]]
    # A step's batches, across the ranks, alike: (windows of 8 batches here; quantiles of 32 samples)
    assert np.median(across) < 0.5 * np.median(unbucketed)


def test_lengths_as_a_function_bucket_an_iterable_dataset():
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, TokenStream(LENGTHS), batch_size=B, lengths=length, seed=5,
                                   num_workers=STREAMS, collate_fn=pad_tokens,
                                   generator=torch.Generator().manual_seed(2), timeout=60) as dl:
            got = as_lists(dl)
        data = dpex.BucketedIterable(TokenStream(LENGTHS), length, B, seed=5)
        want = as_lists(DataLoader(data, batch_size=B, num_workers=STREAMS, collate_fn=pad_tokens,
                                   generator=torch.Generator().manual_seed(2)))
        assert got == want
        with pytest.raises(dpex.DpexConfigError, match="function of a sample"):
            dpex.RemoteDataLoader(c.address, TokenStream(LENGTHS), batch_size=B, lengths=LENGTHS)


@pytest.mark.parametrize("taken", [3, 16])  # mid-window, and at a window's end
def test_a_stream_resumed_mid_window_goes_on_bitwise(taken):
    def loader(address):
        data = dpex.BucketedIterable(StatefulTokenStream(LENGTHS), length, B, seed=5, window_batches=8)
        return dpex.RemoteDataLoader(address, data, batch_size=B, num_workers=STREAMS, collate_fn=pad_tokens,
                                     generator=torch.Generator().manual_seed(7), timeout=60)
    with test_cluster(num_workers=2) as c:
        with loader(c.address) as dl:
            whole = as_lists(dl)
        with loader(c.address) as dl:
            it = iter(dl)
            first = as_lists(next(it) for _ in range(taken))
            state = dl.state_dict()
        with loader(c.address) as dl:
            dl.load_state_dict(state)
            rest = as_lists(dl)
    assert first + rest == whole
