"""dpex.client.sampling: EpochPlans draws each epoch as torch's DataLoader
would (torch is the oracle): the same batches for the same seed, generator
or global RNG, DistributedSampler's shares, len(), set_epoch and resize."""
import pytest
import torch
import torch.utils.data as tud

from dpex.client.sampling import EpochPlans, Indices
from dpex.plan import samplers
from dpex.proto import dispatcher_pb2 as dpb


def plans(length=23, iterable=False, compact=False, **kw):
    args = dict(batch_size=4, drop_last=False, shuffle=False, seed=None, sampler=None, batch_sampler=None,
                generator=None, distributed=False, num_consumers=1, consumer_index=0, num_streams=1,
                compact=compact, unbatched=False, reproducible=True)
    args.update(kw)
    return EpochPlans(length, iterable, **args)


def draw(ours):
    """An epoch's plan, drawn at its first index batch, and the epoch read to its end."""
    epoch = ours.begin(0)
    drawn = epoch.plan()
    epoch.ask(len(ours) + 1)
    return drawn


def batches(drawn):
    return [list(b.indices) for b in drawn.batches]


@pytest.mark.parametrize("kw", [dict(shuffle=True), dict(batch_size=5, drop_last=True), dict(batch_size=1)])
def test_epochs_are_torchs_for_the_same_global_seed(kw):
    ours = plans(**kw)
    torch.manual_seed(3)
    drawn = [batches(draw(ours)) for _ in range(3)]
    torch.manual_seed(3)
    theirs = tud.DataLoader(list(range(23)), **{"batch_size": 4, **kw}, collate_fn=list)
    assert drawn == [list(theirs) for _ in range(3)] and len(ours) == len(theirs)


def test_a_seed_is_a_seeded_generator_and_a_compact_plan_describes_it():
    seeded = plans(shuffle=True, seed=7, compact=True)
    drawn = draw(seeded)
    assert drawn.sampler is not None and drawn.batches == [] and seeded.generator is not None
    theirs = tud.DataLoader(list(range(23)), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7),
                            collate_fn=list)
    assert samplers.batches(drawn.sampler, 0, samplers.num_batches(drawn.sampler)) == list(theirs)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_distributed_consumers_plan_distributed_samplers_shares_and_follow_set_epoch(rank):
    ours = plans(shuffle=True, seed=5, distributed=True, num_consumers=3, consumer_index=rank)
    sampler = tud.DistributedSampler(list(range(23)), num_replicas=3, rank=rank, shuffle=True, seed=5)
    theirs = tud.DataLoader(list(range(23)), batch_size=4, sampler=sampler, collate_fn=list)
    ours.set_epoch(2), sampler.set_epoch(2)
    drawn = draw(ours)
    assert batches(drawn) == list(theirs)
    places = [p for b in drawn.batches for p in b.places] or None
    assert places is None or places == [rank + 3 * j for j in range(len(places))]


def test_an_iterable_dataset_draws_only_a_base_seed_for_its_streams_and_has_torchs_len():
    ours = plans(length=10, iterable=True, num_streams=3, batch_size=4)
    drawn = draw(ours)
    assert (drawn.sampler, drawn.batches, drawn.streams) == (None, [], 3) and len(ours) == 3
    with pytest.raises(TypeError, match="no __len__"):
        len(plans(length=-1, iterable=True))
    with pytest.raises(ValueError, match="expected unspecified shuffle option"):
        plans(iterable=True, shuffle=True)


def test_a_map_style_dataset_needs_a_length_and_a_resize_is_seen_by_the_next_epoch():
    with pytest.raises(Exception, match="needs one"):
        plans(length=-1)
    ours = plans(length=8)
    ours.resize(10)
    assert batches(draw(ours)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and len(ours) == 3


def test_unbatched_elements_are_single_indices_or_whole_lists():
    ours = plans(length=3, batch_size=None, unbatched=True)
    assert [(list(b.indices), b.whole) for b in draw(ours).batches] == [([0], False), ([1], False), ([2], False)]
    sampler_of_lists = plans(length=4, batch_size=None, unbatched=True, sampler=[[0, 1], [2, 3]])
    assert [(list(b.indices), b.whole) for b in draw(sampler_of_lists).batches] == [([0, 1], True), ([2, 3], True)]
    assert isinstance(Indices(5)[3], int) and isinstance(draw(ours).batches[0], dpb.IndexBatch)
