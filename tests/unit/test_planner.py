"""dpex.worker.planner: described splits computed off the scheduler's lock,
one thread per drawn order, released ones skipped, errors reported."""
import threading

import torch
import torch.utils.data as tud

from dpex.client.sampling import Indices
from dpex.plan import samplers
from dpex.proto import dispatcher_pb2 as dpb
from dpex.worker.planner import Planner


def described(sampler, batch_size=4):
    loader = tud.DataLoader(Indices(40), sampler=sampler, batch_size=batch_size, collate_fn=list)
    iter(loader)
    return samplers.describe(loader)


def run(splits, wanted=lambda split: True):
    done, finished = {}, threading.Event()

    def planned(split, batches, places, error):
        done[split.first_seq] = (batches, places, error)
        if len(done) == sum(map(wanted, splits)):
            finished.set()
    planner = Planner(lambda split: split, wanted, planned)
    for split in splits:
        planner.plan(split)
    assert finished.wait(60)
    planner.close()
    return done


def test_the_splits_of_a_drawn_order_are_its_batches_and_places_and_released_ones_are_skipped():
    spec = described(tud.RandomSampler(Indices(40), generator=torch.Generator().manual_seed(2)))
    splits = [dpb.Split(first_seq=f, num_batches=2, sampler=spec) for f in (0, 2, 4, 6)]
    done = run(splits, wanted=lambda split: split.first_seq != 4)
    assert sorted(done) == [0, 2, 6]
    for first, (batches, places, error) in done.items():
        assert error is None
        assert batches == samplers.batches(spec, first, 2) and places == samplers.places(spec, first, 2)


def test_a_split_that_cannot_be_computed_is_reported_with_its_error():
    spec = described(tud.SequentialSampler(Indices(40)))
    spec.torch_version = "0.0.1"  # another torch release: refused
    (batches, places, error), = run([dpb.Split(first_seq=0, num_batches=1, sampler=spec)]).values()
    assert batches is None and places is None and "torch 0.0.1" in str(error)


def test_the_splits_of_an_epoch_that_draws_no_order_are_planned_as_they_came():
    """A SequentialSampler's splits: once planned on threads of their own, the
    later ones could be made first, each batch then by another process than
    torch's index queues give it (the suite met batch 4 of 16 made by process 0 of 3)."""
    spec = described(tud.SequentialSampler(Indices(40)))
    order, threads, finished = [], set(), threading.Event()

    def planned(split, batches, places, error):
        order.append(split.first_seq)
        threads.add(threading.get_ident())
        if len(order) == 5:
            finished.set()
    planner = Planner(lambda split: split, lambda split: True, planned)
    for first in (0, 2, 4, 6, 8):
        planner.plan(dpb.Split(job_id=1, epoch=0, first_seq=first, num_batches=2, sampler=spec))
    assert finished.wait(60)
    planner.close()
    assert order == [0, 2, 4, 6, 8] and len(threads) == 1
