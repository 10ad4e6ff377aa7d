"""torch is the oracle: each scenario runs through torch.utils.data.DataLoader
and through DpexDataLoader(distribute_mode=True) unchanged, and what comes
out (values and their types, exceptions, warnings, len, argument errors) must
be the same. Scenarios follow torch's own DataLoader tests."""
import collections
import dataclasses
import fractions
import multiprocessing
import os
import re
import subprocess
import sys
import warnings

import cloudpickle
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

import dpex
from dpex import DpexDataLoader
from dpex.testing import oracle_context
from dpex.testing.compare import plain
from dpex.testing.datasets import Crashing

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import tests/


# ---- datasets, as in torch's tests ---------------------------------------------------------------
class ErrorEvery(Dataset):
    """Raises ``error`` for every ``every``-th index."""

    def __init__(self, n, every=3, error=KeyError):
        self.n, self.every, self.error = n, every, error

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i % self.every == 0:
            raise self.error(f"bad {i}")
        return torch.tensor([i, 2 * i])


class NeedsTwo(Exception):
    """Cannot be built from a message: torch raises a RuntimeError instead."""

    def __init__(self, a, b):
        super().__init__(a, b)


class TwoArgErrors(Dataset):
    def __len__(self):
        return 6

    def __getitem__(self, i):
        if i % 4 == 0:
            raise NeedsTwo(f"bad {i}", i)
        return i


class Mixed(Dataset):
    """Samples of numpy scalars, arrays, dicts and tuples; a list index reads a list."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if isinstance(i, list):
            return [np.int64(j) for j in i]
        return np.float32(i), {"a": np.arange(i), "s": f"x{i}"}


class PreBatched(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.full((3, 2), i)


class Getitems(Dataset):
    """torch's fetcher uses __getitems__ when a dataset has it."""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        raise AssertionError("__getitems__ should be used")

    def __getitems__(self, indices):
        return [torch.tensor(i * 10) for i in indices]


class ListSampler(Sampler):
    def __init__(self):
        pass

    def __iter__(self):
        return iter([[0, 1], [2, 3, 4], [5], [6, 7]])

    def __len__(self):
        return 4


class Range(IterableDataset):
    def __init__(self, n, reported=None):
        self.n, self.reported = n, reported

    def __len__(self):
        return self.n if self.reported is None else self.reported

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k, w = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, self.n, w):
            yield np.array([i, -i])


class Growing(Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


# ---- running a scenario through both ---------------------------------------------------------------
def kind(e):
    """The exception's own class: Dpex raises a subclass that is also a
    DpexWorkerError, or a DpexWorkerError where torch raises a RuntimeError."""
    if not isinstance(e, dpex.DpexWorkerError):
        return type(e)
    return next(c for c in type(e).__mro__[1:] if not issubclass(c, dpex.DpexError))


def exception(e):
    """What a user sees of an exception: its class, and the remote traceback's last line."""
    lines = [ln for ln in str(e).splitlines() if re.match(r"[\w.]+: ", ln)]
    return ("raised", kind(e).__name__, lines[-1] if lines else str(e))


def outcome(make, catch=True):
    """One epoch as a loop that catches exceptions and goes on, as torch's
    _test_error does: [("batch", plain) | ("raised", type, line)], warnings."""
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = make()
        it = iter(loader)
        while True:
            try:
                out.append(("batch", plain(next(it))))
            except StopIteration:
                break
            except Exception as e:  # noqa: BLE001 - the outcome compared
                out.append(exception(e))
                if not catch:
                    break
    seen = [re.sub(" at 0x[0-9a-f]+", "", str(w.message)) for w in caught
            if "DataLoader" in str(w.message) or "IterableDataset" in str(w.message)]
    return out, seen


def both(cluster, dataset_fn, catch=True, **kwargs):
    """The scenario's outcome through torch's DataLoader and through Dpex."""
    gen = kwargs.pop("seed", None)

    def make(cls, **extra):
        def build():
            kw = dict(kwargs)
            if cls is DataLoader and kw.get("num_workers") and kw.get("multiprocessing_context") in (None, "fork"):
                # Fork would copy this process's gRPC threads (a forked worker may hang); what
                # "context_fork" checks is that Dpex accepts the argument as torch does.
                kw["multiprocessing_context"] = oracle_context()
            if gen is not None:
                kw["generator"] = torch.Generator().manual_seed(gen)
            return cls(dataset_fn(), **extra, **kw)
        return build
    theirs = outcome(make(DataLoader), catch)
    ours = outcome(make(DpexDataLoader, distribute_mode=True, head_address=cluster.address), catch)
    return theirs, ours


# ---- scenarios --------------------------------------------------------------------------------------
SCENARIOS = {
    # auto-batching off (batch_size=None): each element is one item, default_convert'ed
    "unbatched": (lambda: Mixed(6), dict(batch_size=None)),
    "unbatched_shuffled_prebatched": (PreBatched, dict(batch_size=None, shuffle=True, seed=3)),
    "unbatched_list_sampler": (lambda: Mixed(8), dict(batch_size=None, sampler=ListSampler())),
    "unbatched_collate_fn": (lambda: Mixed(4), dict(batch_size=None, collate_fn=repr)),
    "unbatched_iterable": (lambda: Range(5), dict(batch_size=None)),
    "unbatched_iterable_two_workers": (lambda: Range(7), dict(batch_size=None, num_workers=2)),
    "getitems": (Getitems, dict(batch_size=4)),
    "getitems_shuffled": (Getitems, dict(batch_size=3, shuffle=True, seed=1, drop_last=True)),
    # exceptions: raised as their own type, and the loop goes on
    "errors_in_getitem": (lambda: ErrorEvery(20), dict(batch_size=2, num_workers=2)),
    # (torch without workers raises in its own process, the exception as it is: Dpex's are torch's workers')
    "errors_unbatched": (lambda: ErrorEvery(7, error=ValueError), dict(batch_size=None, num_workers=1)),
    "errors_not_rebuildable": (TwoArgErrors, dict(batch_size=3, num_workers=1)),
    "errors_in_collate": (lambda: Mixed(4), dict(batch_size=2, num_workers=1, collate_fn=torch.stack)),
    # multiprocessing_context is accepted as torch accepts it
    "context_fork": (PreBatched, dict(batch_size=2, num_workers=1, multiprocessing_context="fork")),
    "context_forkserver": (PreBatched, dict(batch_size=2, num_workers=1,
                                                  multiprocessing_context="forkserver")),
    "context_object": (PreBatched, dict(batch_size=2, num_workers=1,
                                              multiprocessing_context=multiprocessing.get_context("spawn"))),
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_outcome_as_torch(cluster, name):
    dataset_fn, kwargs = SCENARIOS[name]
    theirs, ours = both(cluster, dataset_fn, **kwargs)
    assert theirs == ours


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterable_dataset_longer_than_its_len_warns(cluster, num_workers):
    loaders = [DataLoader(Range(6, reported=2), batch_size=2, num_workers=num_workers,
                          multiprocessing_context=oracle_context() if num_workers else None),
               DpexDataLoader(Range(6, reported=2), distribute_mode=True, head_address=cluster.address,
                              batch_size=2, num_workers=num_workers)]
    assert len(loaders[0]) == len(loaders[1]) == 1
    theirs, ours = [outcome(lambda loader=loader: loader) for loader in loaders]
    assert theirs == ours and ours[1]  # torch compares batches yielded with len(dataset)


def test_a_caught_error_does_not_end_the_epoch_and_counts_once(cluster):
    (theirs, _), (ours, _) = both(cluster, lambda: ErrorEvery(30, every=4), batch_size=3, shuffle=True, seed=5,
                                  num_workers=2)
    assert theirs == ours
    assert 0 < sum(1 for r in ours if r[0] == "raised") < 10  # batches holding one of 0, 4, ..., 28
    assert len(ours) == 10  # every batch once: the failed ones count as given


def test_the_exception_is_the_users_type_and_a_dpex_worker_error(cluster):
    with DpexDataLoader(ErrorEvery(6), distribute_mode=True, head_address=cluster.address, batch_size=2) as dl:
        with pytest.raises(KeyError) as info:
            next(iter(dl))
    e = info.value
    assert isinstance(e, dpex.DpexWorkerError) and type(e).__name__ == "KeyError"
    assert e.worker in cluster.worker_addresses and e.sample_index == 0 and e.stage == "getitem"
    assert e.process == 0 and "Caught KeyError in DataLoader worker process 0" in str(e)
    assert "raise self.error(f\"bad {i}\")" in e.remote_traceback
    assert str(e).startswith("KeyError: 'bad 0' (raised in dataset[0] on worker")  # not repr()'d as KeyError's
    copy = __import__("pickle").loads(__import__("pickle").dumps(e))
    assert type(copy) is type(e) and copy.args == e.args and copy.worker == e.worker


@pytest.mark.parametrize("cls", [dpex.DpexError, dpex.DpexAuthError, dpex.DpexCancelledError, dpex.DpexConfigError,
                                 dpex.DpexConflictError, dpex.DpexConnectionError, dpex.DpexNotFoundError,
                                 dpex.DpexTimeoutError, dpex.DpexWireError, dpex.DpexWorkerError])
def test_every_dpex_exception_is_built_from_a_message_and_pickles(cls):
    import pickle
    e = cls("something went wrong")
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is cls and str(copy) == "something went wrong"


def test_a_killed_batch_process_reads_as_torchs(cluster):
    # torch: "RuntimeError: DataLoader worker (pid N) is killed by signal: Killed."
    with DpexDataLoader(Crashing(8, bad=2), distribute_mode=True, head_address=cluster.address,
                        batch_size=2, timeout=60) as dl:
        got = []
        # (the pid and signal are named when the pool saw the process's exit code; else torch's other words)
        with pytest.raises(RuntimeError, match=r"DataLoader worker (\(pid \d+\) is killed by signal: Killed\.|"
                                               r"exited unexpectedly)"):
            for batch in dl:
                got.append(batch["y"].tolist())
    assert got == [[0, 1]]


@pytest.mark.parametrize("kwargs", [
    dict(multiprocessing_context="bad", num_workers=1),
    dict(multiprocessing_context="spawn"),
    dict(batch_size=None, drop_last=True),
    dict(batch_sampler=[[1]], batch_size=3),
    dict(sampler=[0], shuffle=True),
    dict(num_workers=-1),
    dict(prefetch_factor=3),
    dict(persistent_workers=True),
    dict(timeout=-1),
    dict(no_such_argument=1),
])
def test_argument_errors_are_torchs(kwargs):
    def error(cls):
        try:
            cls(Mixed(4), **kwargs)
        except Exception as e:  # noqa: BLE001 - compared
            return type(e), str(e).replace("DpexDataLoader", "DataLoader")
        return None
    theirs = error(DataLoader)
    assert theirs is not None
    ours = error(lambda *a, **k: DpexDataLoader(*a, distribute_mode=True, head_address="127.0.0.1:1", **k))
    assert ours == theirs


def test_attributes_and_typing_as_torchs(cluster):
    with DpexDataLoader(Mixed(10), distribute_mode=True, head_address=cluster.address, batch_size=3) as dl:
        assert isinstance(dl, DataLoader) and DpexDataLoader[int] is not None
        assert (dl.batch_size, dl.drop_last, dl.num_workers, dl.timeout) == (3, False, 0, 0)
        for attr in ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"):
            with pytest.raises(ValueError, match=f"{attr} attribute should not be set after DpexDataLoader is "
                                                 "initialized"):
                setattr(dl, attr, None)


def test_len_follows_the_dataset(cluster):
    items = list(range(10))
    theirs = DataLoader(Growing(list(items)), batch_size=4)
    with DpexDataLoader(Growing(list(items)), distribute_mode=True, head_address=cluster.address,
                        batch_size=4) as ours:
        for loader in (theirs, ours):
            loader.dataset.items.extend(range(10, 13))
        assert len(ours) == len(theirs) == 4


class Offset(Dataset):
    def __init__(self):
        self.start = 100

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.start + i


class InitSetsState(Dataset):
    """worker_init_fn is a bound method: it sets state on the dataset __getitem__ reads."""

    def __init__(self):
        self.value = -1

    def init(self, worker_id):
        self.value = 7 + worker_id

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return self.value


def test_the_dataset_is_taken_at_iter(cluster):
    outcomes = []
    for cls, extra in ((DataLoader, {}), (DpexDataLoader, dict(distribute_mode=True, head_address=cluster.address))):
        dataset = Offset()
        loader = cls(dataset, batch_size=4, **extra)
        first = [b.tolist() for b in loader]
        dataset.start = 0  # changed between construction (and an epoch) and iter(): seen, as in torch
        items = Growing(list(range(5)))
        grown = cls(items, batch_size=4, **extra)
        items.items.extend([5, 6, 7, 8])
        outcomes.append((first, [b.tolist() for b in loader], len(grown), [b.tolist() for b in grown]))
    assert outcomes[0] == outcomes[1]
    assert outcomes[1][1] == [[0, 1, 2, 3], [4, 5]] and outcomes[1][2] == 3


def test_an_unchanged_dataset_is_not_shipped_again(cluster):
    with DpexDataLoader(Offset(), distribute_mode=True, head_address=cluster.address, batch_size=3) as dl:
        job = dl._remote.job_id
        assert [list(dl) for _ in range(2)] and dl._remote.job_id == job
        dl.dataset.start = 1
        assert [b.tolist() for b in dl] == [[1, 2, 3], [4, 5, 6]] and dl._remote.job_id != job


def test_worker_init_fn_and_getitem_see_one_dataset(cluster):
    (theirs, _), (ours, _) = [outcome(lambda: DataLoader(ds, batch_size=2, num_workers=1, worker_init_fn=ds.init,
                                                                 multiprocessing_context=oracle_context())
                                      if cls is DataLoader else
                                      DpexDataLoader(ds, distribute_mode=True, head_address=cluster.address,
                                                     batch_size=2, num_workers=1, worker_init_fn=ds.init))
                              for cls, ds in ((DataLoader, InitSetsState()), (DpexDataLoader, InitSetsState()))]
    assert theirs == ours == [("batch", ("tensor", "torch.int64", (2,), [7, 7]))] * 2


# ---- the user's own classes come back as themselves (torch's TestNamedTupleDataLoader) ------------------
class NamedTupleDataset(Dataset):
    Batch = collections.namedtuple("Batch", ["data", "label"])  # found by no import path

    @dataclasses.dataclass
    class Sample:
        value: torch.Tensor
        weight: fractions.Fraction

    def __init__(self, records=True):
        self.records = records

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if self.records:
            return self.Batch(torch.tensor([i]), i)
        return self.Sample(torch.full((2,), i), fractions.Fraction(i, 3))


def _as_is(samples):
    return samples


@pytest.mark.parametrize("records,kwargs", [(True, dict(batch_size=2)), (True, dict(batch_size=None)),
                                            (False, dict(batch_size=None)),
                                            (False, dict(batch_size=2, collate_fn=_as_is))])
def test_the_users_classes_come_back_as_themselves(cluster, records, kwargs):
    def types(value):
        if isinstance(value, (list, tuple)):
            return (type(value), [types(v) for v in value])
        return type(value)
    outcomes = []
    for cls, extra in ((DataLoader, {}), (DpexDataLoader, dict(distribute_mode=True, head_address=cluster.address))):
        batches = list(cls(NamedTupleDataset(records), **kwargs, **extra))
        outcomes.append(([types(b) for b in batches], repr(batches)))
    assert outcomes[0] == outcomes[1]
    first = outcomes[1][0][0]
    assert (first[0] if isinstance(first, tuple) else first) in (NamedTupleDataset.Batch, NamedTupleDataset.Sample,
                                                                 list)


SCRIPT = """
import dataclasses, sys
import torch
from torch.utils.data import Dataset
from dpex import DpexDataLoader

@dataclasses.dataclass
class Pair:                       # defined in __main__: travels by value, comes back as this class
    x: torch.Tensor
    tag: set

class Pairs(Dataset):
    def __len__(self):
        return 3
    def __getitem__(self, i):
        return Pair(torch.tensor(i), {i})

loader = DpexDataLoader(Pairs(), distribute_mode=True, head_address=sys.argv[1], batch_size=None)
got = list(loader)
assert all(type(p) is Pair for p in got), [type(p) for p in got]
print([(p.x.item(), p.tag) for p in got])
"""


def test_a_class_defined_in_the_main_script_comes_back_as_itself(cluster, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), cluster.address], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[(0, {0}), (1, {1}), (2, {2})]"


# ---- batch_size=None through resume and DDP -------------------------------------------------------------
@pytest.mark.parametrize("sampler", [None, ListSampler()], ids=["shuffled", "index lists"])
def test_an_unbatched_loader_resumes_exactly_and_its_epoch_is_torchs(cluster, sampler):
    def make(cls=DpexDataLoader, **extra):
        return cls(Mixed(8), batch_size=None, shuffle=sampler is None, sampler=sampler,
                   generator=torch.Generator().manual_seed(4), **extra)
    ours = dict(distribute_mode=True, head_address=cluster.address)
    loader = make(**ours)
    whole = [plain(x) for _ in range(2) for x in loader]
    theirs = make(DataLoader)
    assert whole == [plain(x) for _ in range(2) for x in theirs]
    stop_at = 3
    first, it = [], iter(make(**ours))
    loader = it._loader
    for x in it:
        first.append(plain(x))
        if len(first) == stop_at:
            break
    state = loader.state_dict()
    resumed = make(**ours)
    resumed.load_state_dict(state)
    rest = [plain(x) for x in resumed] + [plain(x) for x in resumed]
    assert first + rest == whole


def test_unbatched_ddp_consumers_get_distributed_samplers_shares(cluster):
    for rank in range(2):
        theirs = DataLoader(Mixed(7), batch_size=None,
                            sampler=torch.utils.data.DistributedSampler(Mixed(7), num_replicas=2, rank=rank, seed=3))
        with dpex.RemoteDataLoader(cluster.address, Mixed(7), batch_size=None, shuffle=True, seed=3,
                                   num_consumers=2, consumer_index=rank, job_name="unbatched-ddp") as ours:
            assert [plain(x) for x in ours] == [plain(x) for x in theirs]


def test_more_workers_than_cores_warns_as_torchs(monkeypatch):
    from dpex.launch import embedded
    monkeypatch.delenv("DPEX_DISPATCHER", raising=False)  # "auto": the embedded cluster, on this machine's cores
    n = len(os.sched_getaffinity(0)) + 1
    said = []
    for cls, extra in ((DataLoader, dict(multiprocessing_context=oracle_context())),
                       (DpexDataLoader, dict(distribute_mode=True))):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader = cls(list(range(4)), batch_size=2, num_workers=n, **extra)
            assert next(iter(loader)).tolist() == [0, 1]
        said.append([str(w.message) for w in caught if "worker processes in total" in str(w.message)])
    embedded.stop_embedded()
    assert said[0] == said[1] and said[0]


class SharedCounter(Dataset):
    """Shared memory of this machine inside the dataset (torch's test_dataloader has such)."""

    def __init__(self):
        self.count = multiprocessing.get_context("spawn").Value("i", 0)

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return i


def test_what_cannot_cross_hosts_is_refused_with_the_reason():
    with pytest.raises(dpex.DpexConfigError, match=r"the dataset cannot be shipped to the Dpex workers, which may run "
                                                   r"on other hosts .*Synchronized objects .*mp\.Value"):
        DpexDataLoader(SharedCounter(), distribute_mode=True, head_address="127.0.0.1:1", batch_size=2)


class Segfaults(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            import ctypes
            ctypes.string_at(0)  # SIGSEGV in the worker's batch process
        return i


def test_a_segfault_names_the_signal_and_the_sample(cluster):
    with DpexDataLoader(Segfaults(), distribute_mode=True, head_address=cluster.address, batch_size=2,
                        timeout=60) as dl:
        got = []
        with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid \d+\) is killed by signal: Segmentation "
                                               r"fault\. It was making this batch, reading dataset\[5\]") as info:
            for batch in dl:
                got.append(batch.tolist())
    assert got == [[0, 1], [2, 3]] and info.value.sample_index == 5


# ---- each worker has its queue (torch's TestIndividualWorkerQueue, TestOutOfOrderDataLoader) ---------------
class WorkerQueue(Dataset):
    """torch's TestWorkerQueueDataset: each sample says which worker made it."""

    def __init__(self, data):
        self.data = data
        self.worker_id = None

    def worker_init_fn(self, worker_id):
        self.worker_id = worker_id

    def __getitem__(self, item):
        return self.worker_id, self.data[item]

    def __len__(self):
        return len(self.data)


@pytest.mark.parametrize("batch_size,num_workers", [(8, 1), (8, 3), (32, 5)])
def test_batch_i_is_made_by_worker_i_mod_n_as_torchs_index_queues(batch_size, num_workers):
    dataset = WorkerQueue(list(range(128)))
    outcomes = []
    for cls, extra in ((DataLoader, {}), (DpexDataLoader, dict(distribute_mode=True))):  # the embedded cluster
        loader = cls(dataset, batch_size=batch_size, num_workers=num_workers, timeout=60,
                     worker_init_fn=dataset.worker_init_fn, **extra)
        outcomes.append([(ids.tolist(), samples.tolist()) for ids, samples in loader])
    assert outcomes[0] == outcomes[1]
    assert [ids[0] for ids, _ in outcomes[1]] == [i % num_workers for i in range(128 // batch_size)]


class SlowFirst(Dataset):
    """torch's TestSlowIndexDataset, whose sample 0 is slow: here it waits until the last sample is made."""

    def __init__(self, end, flag):
        self.end, self.flag = end, flag

    def __getitem__(self, idx):
        if idx == 0:
            while not os.path.exists(self.flag):
                os.sched_yield()
        if idx == self.end - 1:
            open(self.flag, "w").close()
        return torch.utils.data.get_worker_info().id, idx

    def __len__(self):
        return self.end


def test_out_of_order_batches_pass_a_slow_worker_as_torchs(tmp_path):
    outcomes = []
    for cls, extra in ((DataLoader, {}), (DpexDataLoader, dict(distribute_mode=True))):
        flag = tmp_path / cls.__name__
        loader = cls(SlowFirst(10, str(flag)), num_workers=2, prefetch_factor=2, in_order=False, timeout=60, **extra)
        outcomes.append([(int(w), int(i)) for w, i in loader])
    # Worker 0 is held by sample 0 with sample 2 queued behind it; worker 1 makes all the rest. Sample 0 is let go
    # once sample 9 is being made, so whether it arrives before the last batches of worker 1 follows timing (in
    # torch's loader too); 1 and 3 were made before it.
    for outcome in outcomes:
        assert sorted(outcome) == [(0, 0), (0, 2), (1, 1), (1, 3), (1, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9)]
        assert [s for s in outcome if s[1] in (0, 1, 2, 3)] == [(1, 1), (1, 3), (0, 0), (0, 2)]
