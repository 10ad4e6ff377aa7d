"""Described samplers expand to exactly torch's batches, and leave every RNG where torch would."""
import itertools
import random

import pytest
import torch
import torch.utils.data as tud

from dpex.client.sampling import Indices
from dpex.errors import DpexConfigError
from dpex.plan import samplers
from dpex.proto import dispatcher_pb2 as dpb


def _loader(n, generator=None, **kw):
    return tud.DataLoader(Indices(n), collate_fn=list, generator=generator, **kw)


def _epochs(make, seed, epochs, compact):
    """Each epoch's batches and the RNG states after it, torch's way or described."""
    torch.manual_seed(seed)
    loader, generator = make()
    out = []
    for epoch in range(epochs):
        if isinstance(loader.sampler, tud.DistributedSampler):
            loader.sampler.set_epoch(epoch)
        it = iter(loader)
        if compact:
            spec = samplers.describe(loader)
            assert spec is not None
            assert len(spec.SerializeToString()) < (4000 if spec.generator_state else 100)
            batches = samplers.batches(spec, 0, samplers.num_batches(spec))
            assert samplers.num_batches(spec) == len(loader)
            for k in range(samplers.draw_calls(spec, len(loader) + 1)):  # the loop ran the sampler out
                samplers.draw_call(spec, loader.sampler.generator, k)
        else:
            batches = [list(b) for b in it]
        out.append((it._base_seed, batches, torch.get_rng_state(),
                    generator.get_state() if generator is not None else None))
    return out


CASES = {
    "sequential-of-another-source": lambda: (_loader(50, batch_size=4, sampler=tud.SequentialSampler(
        range(13))), None),
    "random-of-another-source": lambda: (_loader(50, batch_size=4, sampler=tud.RandomSampler(range(13))), None),
    "sequential": lambda: (_loader(103, batch_size=10), None),
    "sequential-drop-last": lambda: (_loader(103, batch_size=10, drop_last=True), None),
    "shuffle": lambda: (_loader(103, batch_size=10, shuffle=True), None),
    "shuffle-generator": lambda: (lambda g: (_loader(103, batch_size=7, shuffle=True, generator=g), g))(
        torch.Generator().manual_seed(5)),
    "shuffle-drop-last": lambda: (_loader(103, batch_size=10, shuffle=True, drop_last=True), None),
    "random-num-samples-less": lambda: (_loader(100, batch_size=8, sampler=tud.RandomSampler(
        Indices(100), num_samples=37)), None),
    "random-num-samples-more": lambda: (_loader(50, batch_size=8, sampler=tud.RandomSampler(
        Indices(50), num_samples=173)), None),
    "random-num-samples-multiple": lambda: (_loader(50, batch_size=8, sampler=tud.RandomSampler(
        Indices(50), num_samples=100)), None),
    "random-num-samples-more-generator": lambda: (lambda g: (_loader(50, batch_size=8, sampler=tud.RandomSampler(
        Indices(50), num_samples=173, generator=g)), g))(torch.Generator().manual_seed(4)),
    "random-num-samples-multiple-generator": lambda: (lambda g: (_loader(50, batch_size=8, sampler=tud.RandomSampler(
        Indices(50), num_samples=100, generator=g)), g))(torch.Generator().manual_seed(6)),
    "replacement": lambda: (_loader(100, batch_size=8, sampler=tud.RandomSampler(
        Indices(100), replacement=True, num_samples=333)), None),
    "replacement-generator": lambda: (lambda g: (_loader(100, batch_size=8, sampler=tud.RandomSampler(
        Indices(100), replacement=True, num_samples=70, generator=g)), g))(torch.Generator().manual_seed(9)),
    "distributed": lambda: (_loader(103, batch_size=4, sampler=tud.DistributedSampler(
        Indices(103), num_replicas=4, rank=1, seed=3)), None),
    "distributed-drop-last": lambda: (_loader(103, batch_size=4, sampler=tud.DistributedSampler(
        Indices(103), num_replicas=4, rank=3, drop_last=True)), None),
    "distributed-no-shuffle": lambda: (_loader(10, batch_size=3, sampler=tud.DistributedSampler(
        Indices(10), num_replicas=4, rank=2, shuffle=False)), None),
    "distributed-more-ranks-than-samples": lambda: (_loader(3, batch_size=2, sampler=tud.DistributedSampler(
        Indices(3), num_replicas=8, rank=7)), None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_description_expands_to_torchs_batches_and_rng_states(case):
    torchs = _epochs(CASES[case], 1234, 3, compact=False)
    ours = _epochs(CASES[case], 1234, 3, compact=True)
    for (seed_a, batches_a, rng_a, gen_a), (seed_b, batches_b, rng_b, gen_b) in zip(torchs, ours):
        assert batches_a == batches_b
        assert seed_a == seed_b and torch.equal(rng_a, rng_b)
        assert (gen_a is None) == (gen_b is None) and (gen_a is None or torch.equal(gen_a, gen_b))


@pytest.mark.parametrize("length,num_samples,replacement,batch_size,drop_last", [
    (20, None, False, 4, False), (20, None, False, 3, False), (20, None, False, 3, True), (20, 50, False, 6, False),
    (20, 40, False, 5, True), (20, 7, False, 2, False), (100, 70, True, 8, False), (10, 64, True, 16, True),
    (13, None, False, 1, False)])
def test_draw_calls_leave_the_generator_where_torchs_iterator_does_after_each_ask(length, num_samples, replacement,
                                                                                  batch_size, drop_last):
    """After the sampler was asked for r index batches (r past the end: run out), the user's generator
    is where torch's BatchSampler over RandomSampler leaves it (issue 55: a peek, a break)."""
    theirs = torch.Generator().manual_seed(11)
    sampler = tud.RandomSampler(Indices(length), replacement=replacement, num_samples=num_samples, generator=theirs)
    loader = _loader(length, batch_size=batch_size, drop_last=drop_last, sampler=sampler)
    start = theirs.get_state()
    spec = samplers.describe(loader)
    assert torch.equal(theirs.get_state(), start)  # describing draws nothing from the user's generator
    for asked in range(len(loader) + 3):
        theirs.set_state(start)
        it = iter(loader.batch_sampler)
        for _ in range(asked):
            next(it, None)
        ours = torch.Generator()
        ours.set_state(start)
        for k in range(samplers.draw_calls(spec, asked)):
            samplers.draw_call(spec, ours, k)
        assert torch.equal(ours.get_state(), theirs.get_state()), asked


def test_any_run_of_batches_is_the_same_as_in_the_whole():
    torch.manual_seed(0)
    loader = _loader(1000, batch_size=16, shuffle=True)
    iter(loader)
    spec = samplers.describe(loader)
    whole = samplers.batches(spec, 0, samplers.num_batches(spec))
    assert samplers.batches(spec, 5, 4) == whole[5:9]
    assert samplers.batches(spec, 61, 10) == whole[61:]  # the last batch is short
    assert samplers.batches(spec, 63, 1) == []


def test_other_samplers_are_not_described():
    class Mine(tud.SequentialSampler):
        pass
    assert samplers.describe(_loader(10, batch_size=2, sampler=Mine(Indices(10)))) is None
    assert samplers.describe(_loader(10, batch_sampler=[[0, 1], [2]])) is None
    assert samplers.describe(_loader(10, sampler=[3, 1, 2], batch_size=2)) is None


def test_torch_draws_the_same_numbers_in_one_call_as_in_chunks_of_32():
    # RandomSampler draws with replacement 32 at a time; a description draws them at once.
    for high in (10, 10**6, 2**32 // 20 + 5, 2**40):
        a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        chunked = torch.cat([torch.randint(high=high, size=(32,), generator=a) for _ in range(100)]
                            + [torch.randint(high=high, size=(17,), generator=a)])
        assert torch.equal(chunked, torch.randint(high=high, size=(3217,), generator=b))
        assert torch.equal(a.get_state(), b.get_state())


def test_another_torch_release_is_refused_naming_both():
    torch.manual_seed(0)
    loader = _loader(10, batch_size=2, shuffle=True)
    iter(loader)
    spec = samplers.describe(loader)
    spec.torch_version = "1.13.1"
    with pytest.raises(DpexConfigError, match=rf"torch 1\.13\.1.*torch {samplers.torch_version()}"):
        samplers.batches(spec, 0, 1)


def test_a_billion_sequential_samples_cost_nothing():
    loader = _loader(10**9, batch_size=1024)
    iter(loader)
    spec = samplers.describe(loader)
    assert len(spec.SerializeToString()) < 40 and samplers.num_batches(spec) == 976563
    assert samplers.batches(spec, 976562, 5) == [list(range(976562 * 1024, 10**9))]


def test_a_hundred_million_shuffled_spot_checked_against_torchs_sampler():
    n, size = 10**8, 1024
    torch.manual_seed(7)
    loader = _loader(n, batch_size=size, shuffle=True)
    iter(loader)
    spec = samplers.describe(loader)
    torch.manual_seed(7)
    reference = _loader(n, batch_size=size, shuffle=True)
    torch.empty((), dtype=torch.int64).random_()  # the loader's base seed, drawn before the sampler runs
    indices = iter(reference.sampler)  # torch's own RandomSampler, index by index
    picks = sorted(random.Random(3).sample(range(samplers.num_batches(spec)), 5))
    at = 0
    for k in picks:
        expected = list(itertools.islice(indices, k * size - at, k * size - at + size))
        at = (k + 1) * size
        assert samplers.batches(spec, k, 1) == [expected]
    del indices


def test_every_kind_a_plan_can_name_has_its_meaning_in_one_table():
    assert set(samplers._KINDS) == set(dpb.SamplerSpec.Kind.values())
    assert [k for k, kind in samplers._KINDS.items() if kind.sharded] == [dpb.SamplerSpec.DISTRIBUTED,
                                                                          dpb.SamplerSpec.SHUFFLE]
