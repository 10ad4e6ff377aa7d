"""The pieces of a loader's state dict: Progress (seq ranges, streams that
ended) and the elastic reshard of an interrupted epoch."""
import random

import pytest
import torch.utils.data as tud

from dpex.client.checkpoint import EpochState, Progress, elastic
from dpex.client.sampling import Indices
from dpex.plan import samplers


def test_progress_keeps_ranges_and_skips_what_ended_streams_never_make():
    p = Progress()
    for seq in (0, 1, 3, 4, 7):
        p.add(seq)
    assert p.ranges() == [(0, 2), (3, 5), (7, 8)] and p.count == 5
    again = Progress(p.ranges())
    assert again.seqs() == p.seqs() == {0, 1, 3, 4, 7}
    # 3 streams; stream 0 ends after 2 batches: seqs 6, 9, 12 ... never come
    s = Progress(num_streams=3)
    for seq in range(6):
        s.add(seq)
    s.end_stream(0, 2)
    for seq in (7, 8, 10, 11):
        s.add(seq)
    assert s.ranges() == [(0, 13)] and s.count == 10  # one range: the state stays small
    resumed = Progress(s.ranges(), 3, s.ends)
    assert resumed.seqs() == s.seqs() and 9 not in resumed.seqs()
    s.end_stream(1, 4), s.end_stream(2, 4)
    assert s.seqs() == set(range(12)) - {6, 9}  # everything there is was given


def state(ranks, rank, given, n=103, batch_size=4, drop_last=False, sampler_drop_last=False):
    sampler = tud.DistributedSampler(Indices(n), num_replicas=ranks, rank=rank, shuffle=True, seed=1,
                                     drop_last=sampler_drop_last)
    loader = tud.DataLoader(Indices(n), batch_size=batch_size, sampler=sampler, drop_last=drop_last)
    iter(loader)
    spec = samplers.describe(loader)
    progress = Progress()
    for seq in given:
        if seq < samplers.num_batches(spec):
            progress.add(seq)
    return {"epochs_started": 1, "epoch": EpochState(0, 9, samplers.num_batches(spec), spec, None,
                                                     progress).to_dict()}


@pytest.mark.parametrize("before,after", [(4, 2), (2, 3), (2, 1), (3, 3), (1, 4)])
@pytest.mark.parametrize("sampler_drop_last", [False, True])
def test_an_elastic_reshard_gives_each_left_sample_once_in_equal_shares(before, after, sampler_drop_last):
    rng = random.Random(before * 10 + after)
    for _ in range(20):
        n = rng.randrange(1, 120)
        states = [state(before, r, [s for s in range(30) if rng.random() < 0.4], n=n,
                        sampler_drop_last=sampler_drop_last) for r in range(before)]
        given = set()
        for sd in states:
            e = EpochState.from_dict(sd["epoch"])
            batches = e.index_batches()
            given.update(i for seq in e.progress.seqs() for i in batches[seq])
        shares = [elastic(states, after, m, 4, False) for m in range(after)]
        assert len({len(s.batches) for s in shares}) == 1
        left = [i for s in shares for b in s.index_batches() for i in b]
        planned = set()
        for sd in states:
            planned.update(i for b in EpochState.from_dict(sd["epoch"]).index_batches() for i in b)
        want = planned - given
        assert len(set(left)) == len(left) or not sampler_drop_last
        if sampler_drop_last:  # cut to a multiple of the new number of ranks, as DistributedSampler
            assert set(left) <= want and len(left) == len(want) - len(want) % after
        else:  # or padded
            assert set(left) == want and len(left) == len(want) + (-len(want) % after)
        # small in a state dict: the sources, not the shares
        assert shares[0].to_dict()["batches"] is None and shares[0].to_dict()["reshard"]["world"] == after


def test_between_epochs_there_is_nothing_to_reshard():
    assert elastic([{"epochs_started": 2, "epoch": None}] * 2, 3, 0, 4, False) is None


def test_a_resharded_epoch_reshards_again_from_its_small_state():
    """2 ranks -> 3 (each takes some of its share) -> 2: still each left sample once."""
    states = [state(2, r, range(3)) for r in range(2)]
    given = set()
    for sd in states:
        e = EpochState.from_dict(sd["epoch"])
        given.update(i for seq in e.progress.seqs() for i in e.index_batches()[seq])
    middle = []
    for m in range(3):
        share = elastic(states, 3, m, 4, False)
        for seq in range(m + 1):  # rank m was given m + 1 batches of its share
            share.progress.add(seq)
            given.update(share.index_batches()[seq])
        middle.append({"epochs_started": 1, "epoch": share.to_dict()})
        assert middle[-1]["epoch"]["batches"] is None  # the 2 sources, not the share
    left = [i for m in range(2) for b in elastic(middle, 2, m, 4, False).index_batches() for i in b]
    assert set(left) == set(range(103)) - given and not set(left) & given


def test_a_stream_state_is_kept_for_the_batches_given_without_a_gap():
    p = Progress(num_streams=2)
    for seq in range(6):  # stream 0: j 0, 1, 2; stream 1: j 0, 1, 2
        p.offer(seq, b"after %d" % seq)
    for seq in (0, 1, 2, 5):  # seq 3 (stream 1, j 1) not given yet
        p.add(seq)
    assert p.stream_states == {0: (2, b"after 2"), 1: (1, b"after 1")}
    p.add(3)  # the gap closes: stream 1 goes on after j 2 (seq 5)
    assert p.stream_states == {0: (2, b"after 2"), 1: (3, b"after 5")}
    again = EpochState.from_dict(EpochState(0, 1, 0, progress=p, num_streams=2).to_dict()).progress
    assert again.stream_states == p.stream_states and again.seqs() == p.seqs()
