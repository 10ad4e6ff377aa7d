"""A differential tester with torch's DataLoader as the oracle (issue 55).

Random programs of what users do with a loader (``iter``, ``next``, a
``break``, a peek, ``zip(loader, loader)``, ``set_epoch``, a checkpoint
through ``state_dict``/``load_state_dict`` into a new loader, through JSON
or not) over random configurations (map-style or iterable, ``shuffle``, the
user's generator or torch's global RNG, ``drop_last``, ``batch_size``
including None, samplers and batch samplers, ``num_workers`` 0-3,
``persistent_workers``, ``in_order``, ``collate_fn``, ``worker_init_fn``,
``cache``, ``share``; and a new loader's epoch in a forked or spawned child
process) run through ``torch.utils.data.DataLoader`` and
``DpexDataLoader`` side by side, as a hypothesis state machine: every
output, every exception and every random generator's state after each step
must be torch's. A failing program is shrunk by hypothesis; keep it as a
regression test.

A checkpoint has no counterpart in torch's DataLoader: there, the oracle is
the loader that was not interrupted (torch's goes on as it was).
"""
from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing
import queue
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import cloudpickle
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler,
                              SubsetRandomSampler, get_worker_info)

from dpex import torch_private
from dpex.testing.compare import plain

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import dpex.testing

SLOTS = 3  # iterators a program holds at once


class Squares(Dataset):
    """Item i: its index and a tensor of it and its square (plus the offset a
    worker_init_fn set on the worker's copy of the dataset, 0 without one)."""

    def __init__(self, n: int) -> None:
        self.n, self.offset = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"i": i, "t": torch.tensor([i, i * i + self.offset])}


class Shards(IterableDataset):
    """Shards itself by get_worker_info(), as torch's docs teach (its items
    plus the offset a worker_init_fn set, as Squares)."""

    def __init__(self, n: int) -> None:
        self.n, self.offset = n, 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        k, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(k + self.offset, self.n + self.offset, workers))


def init_worker(worker_id: int) -> None:
    """A worker_init_fn of the user's, as torch's docs teach: it sets up the worker's copy of the
    dataset (whose items then say that it ran, in the process that made them, and only with workers)."""
    get_worker_info().dataset.offset = 1000


def as_tuple(batch: list) -> tuple:
    """A collate_fn of the user's."""
    return tuple(batch)


@dataclass(frozen=True)
class Config:
    """One loader's arguments, as a user may write them."""
    iterable: bool
    length: int
    batch_size: int | None
    drop_last: bool
    shuffle: bool
    rng: str            # "generator": the user's torch.Generator; "global": torch's global RNG
    sampler: str        # "none", "subset", "list", "batch_sampler", "list_batches"
    num_workers: int
    persistent: bool
    in_order: bool
    collate: bool       # a collate_fn of the user's
    cache: bool         # cache="memory"
    share: bool
    init: bool = False  # a worker_init_fn of the user's (the regression programs kept before it had none)

    def loader_args(self, generator: Any) -> dict[str, Any]:
        """The arguments both loaders are built with (the same objects' equals)."""
        args: dict[str, Any] = dict(num_workers=self.num_workers, persistent_workers=self.persistent,
                                    in_order=self.in_order, collate_fn=as_tuple if self.collate else None,
                                    worker_init_fn=init_worker if self.init else None)
        if self.iterable:
            return dict(args, batch_size=self.batch_size, drop_last=self.drop_last)
        gen = generator if self.rng == "generator" else None
        if self.sampler == "batch_sampler":
            return dict(args, batch_size=1, batch_sampler=BatchSampler(
                RandomSampler(range(self.length), generator=gen), batch_size=3, drop_last=self.drop_last))
        if self.sampler == "list_batches":
            return dict(args, batch_size=1, batch_sampler=[[i, (i * 7) % self.length] for i in range(self.length)])
        sampler = {"none": None, "subset": SubsetRandomSampler(list(range(0, self.length, 2)), generator=gen),
                   "list": list(reversed(range(self.length)))}[self.sampler]
        return dict(args, batch_size=self.batch_size, drop_last=self.drop_last,
                    shuffle=self.shuffle if sampler is None else None, sampler=sampler, generator=gen)

    def dataset(self) -> Any:
        return Shards(self.length) if self.iterable else Squares(self.length)


@st.composite
def configs(draw: Any) -> Config:
    iterable = draw(st.booleans())
    num_workers = draw(st.integers(0, 3))
    sampler = "none" if iterable else draw(st.sampled_from(["none", "none", "subset", "list", "batch_sampler",
                                                            "list_batches"]))
    batch_size = draw(st.sampled_from([None, 1, 3, 4]))
    return Config(iterable=iterable, length=draw(st.integers(1, 23)),
                  batch_size=batch_size, drop_last=batch_size is not None and draw(st.booleans()),
                  shuffle=not iterable and draw(st.booleans()), rng=draw(st.sampled_from(["generator", "global"])),
                  sampler=sampler, num_workers=num_workers,
                  persistent=num_workers > 0 and draw(st.booleans()),
                  # out of order, torch's workers race: one worker's order is the only one to compare
                  in_order=num_workers > 1 or draw(st.booleans()),
                  collate=draw(st.booleans()), init=draw(st.booleans()), cache=not iterable and draw(st.booleans()),
                  share=draw(st.booleans()))


def outcome(fn: Any) -> Any:
    """What a step gives: its value, or its exception's type (StopIteration included)."""
    try:
        return ("ok", plain(fn()))
    except StopIteration:
        return ("stop",)
    except Exception as e:  # noqa: BLE001 - compared with torch's
        # The frames it was raised through let go of what they held (the iterators a program's step made)
        # now, in this side's turn, not at a collection later in the other's.
        traceback.clear_frames(e.__traceback__)
        return ("raised", type(e).__name__, str(e).splitlines()[0] if str(e) else "")


class Side:
    """One loader (torch's or Dpex's), its generator and the iterators a program holds."""

    def __init__(self, config: Config, make: Any, seed: int) -> None:
        self.config, self.make = config, make
        self.generator = torch.Generator().manual_seed(seed)
        self.loader = make(config.dataset(), **config.loader_args(self.generator))
        self.iterators: dict[int, Any] = {}

    def rng(self) -> tuple[Any, Any]:
        """The user's generator's state and torch's global RNG's."""
        return self.generator.get_state(), torch.get_rng_state()

    def close(self) -> None:
        if isinstance(self.loader, DataLoader):  # torch's: its workers stop now, not when the program is collected
            torch_private.shutdown_workers(self.loader, self.iterators.values())
        self.iterators.clear()
        if hasattr(self.loader, "close"):
            self.loader.close()


def torch_loader(dataset: Any, **kwargs: Any) -> DataLoader:
    from dpex.testing import oracle_context
    if kwargs["num_workers"] > 0:
        kwargs["multiprocessing_context"] = oracle_context()
    return DataLoader(dataset, **kwargs)


def dpex_loader(address: str, config: Config) -> Any:
    from dpex import DpexDataLoader

    def make(dataset: Any, **kwargs: Any) -> Any:
        return DpexDataLoader(dataset, distribute_mode=True, head_address=address, timeout=60,
                              cache="memory" if config.cache else None, share=config.share, **kwargs)
    return make


class Programs(RuleBasedStateMachine):
    """Programs run through torch's DataLoader and Dpex's side by side; set
    ``address`` (a dispatcher's) on the class before running it."""
    address: str = ""
    programs = steps = 0  # run so far, for a long run's tally

    def __init__(self) -> None:
        super().__init__()
        self.sides: tuple[Side, Side] | None = None
        self.given = {k: 0 for k in range(SLOTS)}  # batches each slot's iterator gave (Dpex's)
        # The latest epoch was left early (a peek, a break, zip's second): a state dict then holds it, to
        # resume (as torchdata's), where torch's next iter() begins anew. No checkpoint till the next epoch.
        self.left, self.latest = False, -1
        self.may_fork = False  # the program may start a child process (once)

    # One program in four may start a child (a spawned one imports torch anew: seconds)
    @initialize(config=configs(), seed=st.integers(0, 2**31), child=st.sampled_from([False, False, False, True]))
    def build(self, config: Config, seed: int, child: bool = True) -> None:
        torch.manual_seed(seed)
        self.config, self.seed, self.may_fork = config, seed, child
        Programs.programs += 1
        sides, errors = [], []
        for make in (torch_loader, dpex_loader(self.address, config)):
            try:
                sides.append(Side(config, make, seed))
            except Exception as e:  # noqa: BLE001 - an argument error: compared with torch's
                errors.append(type(e).__name__)
        assert errors in ([], ["ValueError"] * 2, ["TypeError"] * 2), f"construction: {errors}"
        if not errors:
            self.sides = (sides[0], sides[1])

    def both(self, step: Any) -> None:
        """Runs ``step(side)`` on torch's side, then Dpex's, each from the same global RNG state; their
        outcomes and every generator's state after must be equal."""
        Programs.steps += 1
        before = torch.get_rng_state()
        results = []
        for side in self.sides:
            torch.set_rng_state(before)
            results.append((outcome(lambda: step(side)), side.rng()))
        (theirs, their_rng), (ours, our_rng) = results
        if theirs[0] == "raised":  # the same type (Dpex's messages say more: the worker, the sample)
            theirs, ours = theirs[:2], ours[:2]
        assert ours == theirs, f"torch gave {results[0][0]}, Dpex {results[1][0]}"
        assert our_rng[0].equal(their_rng[0]), "the user's generator is not where torch's is"
        assert our_rng[1].equal(their_rng[1]), "torch's global RNG is not where torch's DataLoader leaves it"
        torch.set_rng_state(their_rng[1])

    def one_iterator(self) -> None:
        """torch's persistent workers make every iter() the same iterator, reset: a program holds one."""
        if self.config.persistent:
            for side in self.sides:
                side.iterators.clear()

    @precondition(lambda self: self.sides is not None)
    @rule(slot=st.integers(0, SLOTS - 1))
    def iterate(self, slot: int) -> None:
        self.one_iterator()
        self.given[slot], self.latest = 0, slot
        self.both(lambda side: side.iterators.__setitem__(slot, iter(side.loader)))

    @precondition(lambda self: self.sides is not None and bool(self.sides[0].iterators))
    @rule(data=st.data())
    def next_(self, data: Any) -> None:
        slot = data.draw(st.sampled_from(sorted(self.sides[0].iterators)))
        self.given[slot] += 1
        self.left = self.left and slot != self.latest
        self.both(lambda side: next(side.iterators[slot]))

    @precondition(lambda self: self.sides is not None and bool(self.sides[0].iterators))
    @rule(data=st.data())
    def finish(self, data: Any) -> None:
        slot = data.draw(st.sampled_from(sorted(self.sides[0].iterators)))
        self.both(lambda side: list(side.iterators.pop(slot)))

    @precondition(lambda self: self.sides is not None and bool(self.sides[0].iterators))
    @rule(data=st.data())
    def break_(self, data: Any) -> None:
        slot = data.draw(st.sampled_from(sorted(self.sides[0].iterators)))
        self.left = True
        self.both(lambda side: _drop(side.iterators, slot))

    @precondition(lambda self: self.sides is not None)
    @rule()
    def length(self) -> None:
        self.both(lambda side: len(side.loader))

    @precondition(lambda self: self.sides is not None)
    @rule()
    def peek(self) -> None:
        self.one_iterator()
        self.left = True
        self.both(lambda side: next(iter(side.loader)))

    @precondition(lambda self: self.sides is not None and not self.config.persistent)
    @rule()
    def zip_(self) -> None:  # torch's persistent workers make both iter() one iterator: not a user's program
        self.left = True
        self.both(lambda side: list(zip(side.loader, side.loader)))

    @precondition(lambda self: self.sides is not None)
    @rule(epoch=st.integers(0, 5))
    def set_epoch(self, epoch: int) -> None:
        self.both(lambda side: _set_epoch(side.loader, epoch))

    # A generator inside the user's batch_sampler is not the loader's: no state dict can know it.
    @precondition(lambda self: self.sides is not None and self.config.sampler != "batch_sampler"
                  and not self.left and len(self.sides[1].iterators) <= 1
                  and all(self.given[k] > 0 for k in self.sides[1].iterators))
    @rule(through_json=st.booleans(), into=st.sampled_from(["new", "same"]))
    def checkpoint(self, through_json: bool, into: str = "new") -> None:
        """Dpex's loader is saved and resumes from it, a new loader or the same one (its iterators
        dropped, as a training loop restarted in the same process); torch's goes on as it was."""
        ours = self.sides[1]
        state = ours.loader.state_dict()
        if through_json:
            state = json.loads(json.dumps(state))
        slots = list(ours.iterators)
        if into == "new":
            ours.close()
            ours = Side(self.config, ours.make, self.seed)  # the loader's generator, if any, is set from the state
        ours.iterators.clear()
        ours.loader.load_state_dict(state)
        for slot in slots:
            ours.iterators[slot] = iter(ours.loader)
        self.sides = (self.sides[0], ours)

    @precondition(lambda self: self.sides is not None and self.may_fork)
    @rule(method=st.sampled_from(["fork", "fork", "spawn"]))
    def child(self, method: str) -> None:
        """A child process makes a loader of its own and runs an epoch (one a program: spawn's child imports
        torch anew): Dpex's epoch is torch's, or, in a child forked while gRPC's threads ran in this
        process (where gRPC would hang), a clear error at once. An exception's type is compared, not its
        message (Dpex's says more)."""
        self.may_fork = False
        if method == "spawn":
            self.both(lambda side: in_child(side, method, self.address, self.seed)[:2])
            return
        theirs, ours = (in_child(side, method, self.address, self.seed) for side in self.sides)
        if not (ours[:2] == ("raised", "DpexConfigError") and "forked from one where Dpex had run" in ours[2]):
            assert ours[:2] == theirs[:2], f"in a forked child torch gave {theirs}, Dpex {ours}"

    @invariant()
    def same_generator(self) -> None:
        if self.sides is not None:
            assert self.sides[0].generator.get_state().equal(self.sides[1].generator.get_state())

    def teardown(self) -> None:
        for side in self.sides or ():
            side.close()



def in_child(side: Side, method: str, address: str, seed: int, timeout_s: float = 120.0) -> Any:
    """A new loader of ``side``'s kind made in a child process started by ``method``, from this process's
    global RNG state, and one epoch of it: the epoch's outcome, as ``outcome`` gives it, or ("hang", why)."""
    kind = "torch" if side.make is torch_loader else "dpex"
    context = multiprocessing.get_context(method)
    results = context.Queue()
    child = context.Process(target=_child_epoch, args=(results, kind, address, side.config, seed,
                                                       torch.get_rng_state()))
    child.start()
    try:
        got = results.get(timeout=timeout_s)
    except queue.Empty:
        got = ("hang", f"{kind}'s loader in a {method}ed child: no epoch in {timeout_s:g}s")
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
    return got


def _child_epoch(results: Any, kind: str, address: str, config: Config, seed: int, rng: Any) -> None:
    """In the child: a new loader, one epoch; its outcome (as plain values) sent back."""
    gc.freeze()  # a forked child's copies of the parent's loaders are the parent's: never collected here
    torch.set_rng_state(rng)  # a spawned child as the forked one: from the parent's global RNG
    # torch's, as a user's child makes it: its workers forked (no gRPC thread runs here; the parent's
    # forkserver is not this process's child to use)
    make = DataLoader if kind == "torch" else dpex_loader(address, config)

    def epoch() -> list:
        side = Side(config, make, seed)
        try:
            return list(side.loader)
        finally:
            side.close()
    results.put(outcome(epoch))


def _drop(iterators: dict, slot: int) -> None:
    """The loop breaks: its iterator is dropped."""
    del iterators[slot]


def _set_epoch(loader: Any, epoch: int) -> None:
    for s in (loader.sampler, loader.batch_sampler):
        if hasattr(s, "set_epoch"):
            s.set_epoch(epoch)


def run(address: str, programs: int, steps: int = 8, derandomize: bool = True, seed: int | None = None) -> None:
    """Runs ``programs`` random programs of up to ``steps`` steps against the
    dispatcher at ``address``; raises with the shrunk counterexample on the
    first difference from torch. ``derandomize``: hypothesis's fixed programs;
    ``seed``: fixed programs of this seed instead (runs of other seeds run other programs)."""
    import hypothesis
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import get_state_machine_test
    Programs.address = address
    test = get_state_machine_test(Programs, settings=settings(
        max_examples=programs, stateful_step_count=steps, deadline=None, database=None,
        derandomize=derandomize, suppress_health_check=list(HealthCheck), print_blob=True))
    if seed is not None:
        test = hypothesis.seed(seed)(test)
    with _quick_worker_exits():
        test()


@contextlib.contextmanager
def _quick_worker_exits() -> Iterator[None]:
    """torch's workers that raised in an IterableDataset are waited for 5 s each when their iterator
    goes: not what is compared, and a tenth of a run's time. A tenth of a second while programs run."""
    old = torch_private.set_worker_exit_wait(0.1)
    try:
        yield
    finally:
        torch_private.set_worker_exit_wait(old)


class Slot:
    """Stands in for hypothesis's ``data`` in a program written out by hand: draws ``slot``."""

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def draw(self, strategy: Any) -> int:
        return self.slot


def replay(address: str, config: Config, seed: int, steps: list[tuple[str, dict]]) -> None:
    """Runs one program written out (a shrunk counterexample, kept as a regression test)."""
    Programs.address = address
    machine = Programs()
    with _quick_worker_exits():
        try:
            machine.build(config=config, seed=seed)
            for name, kwargs in steps:
                getattr(machine, name)(**kwargs)
                machine.same_generator()
        finally:
            machine.teardown()
