"""Resume as torchdata's StatefulDataLoader does: the same scenario through
``torchdata.stateful_dataloader.StatefulDataLoader`` (the oracle) and
through ``DpexDataLoader``, comparing what comes out (issue 45)."""
import json

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

import dpex


class Shards(IterableDataset):
    """Shards itself by get_worker_info(), as torch's docs teach: with
    num_workers=0 (no worker info) it yields everything."""

    def __init__(self, n=30):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        k, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(k, self.n, workers))


class Squares(Dataset):
    def __len__(self):
        return 23

    def __getitem__(self, i):
        return i * i


def dpex_loader(dataset, **kwargs):
    return dpex.DpexDataLoader(dataset, distribute_mode=True, timeout=60, **kwargs)


def flat(batches):
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in batches]


def interrupted(make, stop_at, roundtrip=lambda sd: sd, epochs=2):
    """What a loop sees when it is stopped after ``stop_at`` batches of the
    first epoch, its state saved (through ``roundtrip``) and loaded into a
    new loader, which runs the rest and ``epochs - 1`` more."""
    first = make()
    seen = []
    it = iter(first)
    for _ in range(stop_at):
        seen.append(next(it))
    state = roundtrip(first.state_dict())
    del it
    if hasattr(first, "close"):
        first.close()
    second = make()
    second.load_state_dict(state)
    for _ in range(epochs):
        seen.extend(second)
    if hasattr(second, "close"):
        second.close()
    return flat(seen)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("batch_size", [None, 7])
@pytest.mark.parametrize("stop_at", [0, 1, 3])
def test_an_iterable_dataset_resumes_as_torchdata_resumes_it(num_workers, batch_size, stop_at):
    kwargs = dict(batch_size=batch_size, num_workers=num_workers)
    oracle = interrupted(lambda: StatefulDataLoader(Shards(), **kwargs), stop_at)
    got = interrupted(lambda: dpex_loader(Shards(), **kwargs), stop_at)
    assert got == oracle


def test_num_workers_0_is_the_main_process_as_in_torch():
    seen = {}

    class Probe(IterableDataset):
        def __iter__(self):
            yield get_worker_info() is None

    for name, make in (("torch", torch.utils.data.DataLoader), ("dpex", dpex_loader)):
        seen[name] = flat(make(Probe(), batch_size=None, num_workers=0,
                               worker_init_fn=lambda wid: (_ for _ in ()).throw(AssertionError("called"))))
    assert seen["dpex"] == seen["torch"] == [True]


def test_a_state_survives_a_json_round_trip():
    roundtrip = lambda sd: json.loads(json.dumps(sd))  # noqa: E731 - int keys become strings
    kwargs = dict(batch_size=4, num_workers=2)
    oracle = interrupted(lambda: StatefulDataLoader(Shards(), **kwargs), 3, roundtrip)
    got = interrupted(lambda: dpex_loader(Shards(), **kwargs), 3, roundtrip)
    assert got == oracle


@pytest.mark.parametrize("stop_at", [0, 2, 5, 8])
def test_a_shuffled_map_style_loader_resumes_exactly_as_torchdata_does(stop_at):
    # torchdata's own sampler shuffles in another order than torch's DataLoader, which Dpex follows: each
    # resumed run is compared with its own uninterrupted one (torch's DataLoader is Dpex's).
    def kwargs():
        return dict(batch_size=3, shuffle=True, num_workers=2, generator=torch.Generator().manual_seed(5))

    def whole(loader):
        return flat(b for _ in range(2) for b in loader)
    assert interrupted(lambda: StatefulDataLoader(Squares(), **kwargs()), stop_at) == \
        whole(StatefulDataLoader(Squares(), **kwargs()))
    assert interrupted(lambda: dpex_loader(Squares(), **kwargs()), stop_at) == \
        whole(torch.utils.data.DataLoader(Squares(), **kwargs()))


def test_reloading_into_the_same_loader_ends_the_epoch_it_left():
    for make in (lambda: StatefulDataLoader(Squares(), batch_size=3, num_workers=2),
                 lambda: dpex_loader(Squares(), batch_size=3, num_workers=2)):
        loader = make()
        it = iter(loader)
        firsts = [next(it) for _ in range(2)]
        state = loader.state_dict()
        next(it)
        loader.load_state_dict(state)
        rest = flat(loader)
        assert flat(firsts) + rest == flat(make())
        if hasattr(loader, "close"):
            loader.close()


def test_persistent_workers_takes_any_truthy_value_as_torch():
    loader = dpex_loader(Squares(), batch_size=5, num_workers=1, persistent_workers=(False,))
    assert loader.persistent_workers == (False,)  # torch's attribute, as given
    assert len(flat(loader)) == 5
    loader.close()


class OwnIterator(IterableDataset):
    """A dataset that is its own iterator, Stateful (torchdata's CountIterCallsIter): its state exists
    only once iter() made it, so it is restored after iter(), as torchdata restores it."""

    def __init__(self, n=25):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        self.step = info.num_workers if info is not None else 1
        self.next_value = info.id if info is not None else 0
        return self

    def __next__(self):
        if self.next_value >= self.n:
            raise StopIteration
        self.next_value += self.step
        return self.next_value - self.step

    def state_dict(self):
        return {"next_value": self.next_value}

    def load_state_dict(self, state):
        assert self.step  # set by __iter__: fails if called before it
        self.next_value = state["next_value"]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_at", [1, 3])
def test_a_dataset_that_is_its_own_iterator_is_restored_after_iter_as_torchdata_does(num_workers, stop_at):
    kwargs = dict(batch_size=3, num_workers=num_workers)
    oracle = interrupted(lambda: StatefulDataLoader(OwnIterator(), **kwargs), stop_at)
    got = interrupted(lambda: dpex_loader(OwnIterator(), **kwargs), stop_at)
    assert got == oracle


# ---- an IterableDataset's own state across epochs (group 2) -------------------------------------------------
class Counting(IterableDataset):
    """Counts its epochs in ``__iter__``: what a stream sees of the object it iterated the epoch before."""

    def __init__(self, n=12):
        self.n, self.epoch = n, 0

    def __iter__(self):
        self.epoch += 1
        info = get_worker_info()
        k, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter([self.epoch * 100 + i for i in range(k, self.n, workers)])


KEEPS = [dict(num_workers=0), dict(num_workers=2, persistent_workers=True), dict(num_workers=2)]


@pytest.mark.parametrize("kwargs", KEEPS, ids=["main process", "persistent workers", "not persistent"])
def test_an_iterable_datasets_own_state_goes_on_across_epochs_as_in_torch(kwargs):
    """torch iterates one object epoch after epoch with num_workers=0, and each worker's copy with
    persistent_workers; otherwise each epoch's workers start from the trainer's object."""
    outcomes = []
    for make in (lambda: torch.utils.data.DataLoader(Counting(), batch_size=5, **kwargs),
                 lambda: dpex_loader(Counting(), batch_size=5, **kwargs)):
        loader = make()
        outcomes.append([sorted(x for b in loader for x in b.tolist()) for _ in range(3)])
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][2][0] == (300 if kwargs != KEEPS[2] else 100)


@pytest.mark.parametrize("kwargs", KEEPS[:2], ids=["main process", "persistent workers"])
@pytest.mark.parametrize("stop_at", [0, 1, -1], ids=["at the epoch's start", "after one batch", "after its end"])
def test_the_state_carried_across_epochs_survives_a_resume(kwargs, stop_at):
    """Stopped in the second epoch (or after it ended), saved and loaded into a new loader (a new process's
    dataset would count from 0): the rest and the third epoch are those of the uninterrupted run."""
    def run(stop):
        loader, seen = dpex_loader(Counting(), batch_size=5, **kwargs), []
        seen += flat(loader)
        it = iter(loader)
        seen += flat(it) if stop == -1 else [next(it).tolist() for _ in range(stop or 0)]
        if stop is not None:
            state = loader.state_dict()
            del it
            loader.close()
            loader = dpex_loader(Counting(), batch_size=5, **kwargs)
            loader.load_state_dict(state)
            if stop != -1:
                seen += flat(loader)
        else:
            seen += flat(it)
        seen += flat(loader)
        loader.close()
        return sorted(x for b in seen for x in b)
    assert run(stop_at) == run(None) == sorted(e * 100 + i for e in (1, 2, 3) for i in range(12))
