"""Where a sample's draws come from: its place in the epoch (dpex.plan.samplers,
explicit plans, elastic reshards) and the seeds derived from it (dpex.seeding)."""
import random

import numpy as np
import pytest
import torch
import torch.utils.data as tud

from dpex import seeding
from dpex.client.checkpoint import EpochState, Progress, elastic
from dpex.client.sampling import Indices
from dpex.dispatcher.planfiles import PlanFiles
from dpex.plan import samplers
from dpex.proto import dispatcher_pb2 as dpb


def spec_of(sampler, batch_size=4, drop_last=False):
    loader = tud.DataLoader(Indices(len(sampler.dataset) if hasattr(sampler, "dataset") else 60),
                            sampler=sampler, batch_size=batch_size, drop_last=drop_last, collate_fn=list)
    iter(loader)
    return samplers.describe(loader)


def keyed(spec):
    """{place: index} over the whole described epoch."""
    n = samplers.num_batches(spec)
    return {p: i for b, ps in zip(samplers.batches(spec, 0, n), samplers.places(spec, 0, n)) for i, p in zip(b, ps)}


@pytest.mark.parametrize("n", [60, 61, 7])
def test_a_distributed_samples_place_is_its_position_whatever_the_world_size(n):
    def world(size, batch_size):
        out = {}
        for rank in range(size):
            s = tud.DistributedSampler(Indices(n), num_replicas=size, rank=rank, shuffle=True, seed=4)
            out.update(keyed(spec_of(s, batch_size)))
        return out
    two, three = world(2, 4), world(3, 5)
    common = set(two) & set(three)
    assert len(common) >= n and all(two[p] == three[p] for p in common)  # the same sample at each place
    assert all(p < n or two[p] == two[p % n] for p in two)  # padding repeats a sample at a place of its own


def test_places_do_not_depend_on_the_batch_size():
    def flat(batch_size):
        spec = spec_of(tud.RandomSampler(Indices(60), generator=torch.Generator().manual_seed(1)), batch_size)
        return keyed(spec)
    assert flat(4) == flat(7) and sorted(flat(4)) == list(range(60))


def test_consumer_k_of_n_interleaves_its_places_with_the_others():
    spec = spec_of(tud.SequentialSampler(Indices(10)), 3)
    spec.place_offset, spec.place_stride = 1, 3
    assert samplers.places(spec, 0, 4) == [[1, 4, 7], [10, 13, 16], [19, 22, 25], [28]]
    assert samplers.places(spec, 1, 2) == samplers.places(spec, 0, 4)[1:3]
    batches = [dpb.IndexBatch(indices=[5, 6]), dpb.IndexBatch(indices=[1, 2, 3], whole=True),
               dpb.IndexBatch(indices=[9])]
    samplers.place_explicit(batches, 1, 3)
    assert [list(b.places) for b in batches] == [[1, 4], [7], [10]]  # a whole element is one place


def test_seeds_differ_by_place_base_seed_and_purpose_and_set_every_generator():
    seeds = {seeding.for_sample(b, p) for b in (0, 1, -5, 2**63 - 1) for p in range(50)}
    seeds |= {seeding.for_collate(b, p) for b in (0, 1) for p in range(50)}
    assert len(seeds) == 4 * 50 + 2 * 50 and all(0 <= s < 2**63 for s in seeds)  # torch's range: an int64
    assert seeding.for_sample(-5, 3) == seeding.for_sample(-5, 3)

    def draws():
        return torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()
    seeding.seed_globals(seeding.for_sample(7, 11))
    first = draws()
    assert seeding.sample_seed() == seeding.for_sample(7, 11) and seeding.sample_generator() is not None
    draws()
    seeding.seed_globals(seeding.for_sample(7, 11))
    assert draws() == first
    seeding.clear()
    assert seeding.sample_seed() is None and seeding.sample_generator() is None


def test_a_plan_file_keeps_each_batchs_places(tmp_path):
    files = PlanFiles(str(tmp_path))
    batches = [dpb.IndexBatch(indices=[3, 1], places=[0, 2]), dpb.IndexBatch(indices=[7, 8, 9], whole=True,
                                                                             places=[4]),
               dpb.IndexBatch(indices=[5])]
    files.add(1, 0, batches, 2, (1, 0, 0, 9))
    name, count, _ = files.finish(1)
    assert count == 3 and files.read(name, 0, 2) + files.read(name, 1, 1) == batches
    with pytest.raises(ValueError, match="2 places for 1 indices"):
        files.add(2, 0, [dpb.IndexBatch(indices=[1], places=[1, 2])], 2, (1, 0, 1, 9))


def test_an_elastic_reshard_keeps_each_samples_place():
    n, before = 40, 2
    states, whole = [], {}
    for rank in range(before):
        spec = spec_of(tud.DistributedSampler(Indices(n), num_replicas=before, rank=rank, shuffle=True, seed=1))
        whole.update({i: p for p, i in keyed(spec).items()})
        progress = Progress()
        for seq in (0, 1, 3):
            progress.add(seq)
        states.append({"epochs_started": 1, "epoch": EpochState(0, 9, samplers.num_batches(spec), spec, None,
                                                                progress).to_dict()})
    for after in (3, 1):
        for rank in range(after):
            for batch in elastic(states, after, rank, 4, False).batches:
                assert [whole[i] for i in batch.indices] == list(batch.places)  # padding copies too


def test_generators_a_worker_init_fn_seeded_are_the_users_and_keyed_draws_leave_them_alone():
    marks = seeding.seed_marks()
    torch.rand(3), np.random.rand(3), random.random()  # drawing from a generator is not seeding it
    assert seeding.seeded_since(marks) == frozenset()
    torch.manual_seed(12345)
    random.seed(3)
    users = seeding.seeded_since(marks)
    assert users == {"torch", "random"}
    seeding.seed_globals(seeding.for_sample(7, 11), users)
    assert torch.initial_seed() == 12345  # the user's, as under torch's DataLoader
    assert np.random.get_state()[1][0] == np.random.RandomState(seeding.for_sample(7, 11) & 0xFFFFFFFF).get_state()[1][0]
    seeding.clear()


@pytest.mark.parametrize("draws", [1, 700, 15000])
def test_drawing_from_numpy_and_random_is_not_seeding_them_however_many_draws(draws):
    """The Mersenne Twister regenerates its 624 words every 624 draws: a
    worker_init_fn that draws (and so crosses a regeneration) has not seeded
    the generator, and keyed draws still key it. One that seeds and then
    draws has."""
    marks = seeding.seed_marks()
    np.random.rand(draws), [random.random() for _ in range(draws)], torch.rand(draws)
    assert seeding.seeded_since(marks) == frozenset()
    np.random.seed(draws + 5), random.seed(draws + 5)  # not the seed they had: that would draw the same
    np.random.rand(draws), [random.random() for _ in range(draws)]
    assert seeding.seeded_since(marks) == {"numpy", "random"}
