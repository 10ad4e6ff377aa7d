"""A loader's epochs as torch plans them: torch's own samplers, driven by a
DataLoader over indices exactly as torch.utils.data.DataLoader drives them,
so that the same seed draws the same batches; torch's checks, with its words."""
from __future__ import annotations

import copy
import numbers
from types import SimpleNamespace
from typing import Any, Callable, NamedTuple

import torch.utils.data as tud

from dpex import seeding
from dpex.errors import DpexConfigError
from dpex.plan import samplers, shuffle
from dpex.proto import dispatcher_pb2 as dpb


class Indices(tud.Dataset):
    """Stands in for the dataset while planning: item i is i."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        return i

    def __getitems__(self, indices: list[int]) -> list[int]:
        """A whole batch in one call (torch's fetcher uses it): a plan of 10^7 indices is not 10^7 calls."""
        return list(indices)


def index_batch(element: Any, unbatched: bool) -> dpb.IndexBatch:
    """One element of a planning DataLoader's epoch as the plan sends it: a
    batch of indices or, without auto-batching, one index or one list of them."""
    try:
        if not unbatched:
            return dpb.IndexBatch(indices=element)
        if isinstance(element, numbers.Integral):
            return dpb.IndexBatch(indices=[element])
        return dpb.IndexBatch(indices=list(element), whole=True)
    except (TypeError, ValueError):
        raise DpexConfigError(f"the sampler yielded {element!r}: Dpex plans integer indices (or lists of them) "
                              "that the workers look up in their dataset") from None


def check_sampling(batch_size: int | None, shuffle: Any, sampler: Any, batch_sampler: Any, drop_last: bool,
                   generator: Any, collate_fn: Callable | None, worker_init_fn: Callable | None) -> None:
    """torch's own checks of a DataLoader's sampling arguments, with torch's
    messages, made on a stand-in dataset before anything is started."""
    for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
        if fn is not None and not callable(fn):
            raise DpexConfigError(f"{name} must be callable or None, got {type(fn).__name__}")
    if sampler is not None and not hasattr(sampler, "__iter__"):
        raise DpexConfigError(f"sampler must be iterable, got {type(sampler).__name__}")
    if batch_sampler is not None and not hasattr(batch_sampler, "__iter__"):
        raise DpexConfigError(f"batch_sampler must be iterable, got {type(batch_sampler).__name__}")
    tud.DataLoader(Indices(1), batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                   batch_sampler=batch_sampler, drop_last=drop_last, generator=generator)


def check_iterable_args(shuffle: Any, sampler: Any, batch_sampler: Any) -> None:
    """torch's own checks for an IterableDataset, with torch's messages."""
    for name, value in (("shuffle", shuffle), ("sampler", sampler), ("batch_sampler", batch_sampler)):
        if value not in (None, False):
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified {name} option, "
                             f"but got {name}={value}")


_END = object()


def _as_list(indices: list[int]) -> list[int]:
    return indices


class Drawn(NamedTuple):
    """One epoch's plan: its base seed, and a sampler's description, explicit
    index batches, or (an IterableDataset) the number of streams."""
    base_seed: int
    sampler: dpb.SamplerSpec | None
    batches: list[dpb.IndexBatch]
    streams: int


class _Randomness:
    """The states of every random generator a sampler may draw from: torch's,
    numpy's and ``random``'s global ones and the ``generator`` of the loader
    and its samplers; :meth:`restore` puts them back."""

    def __init__(self, loader: tud.DataLoader) -> None:
        import torch
        owners = (loader, loader.sampler, loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None))
        found = {id(g): g for g in (getattr(o, "generator", None) for o in owners) if isinstance(g, torch.Generator)}
        self._generators = [(g, g.get_state()) for g in found.values()]
        self._globals = seeding.global_states()

    def restore(self) -> None:
        for g, state in self._generators:
            g.set_state(state)
        seeding.restore_global_states(self._globals)


class EpochDraw:
    """One epoch drawn from the user's generators when torch's iterator draws
    it: the base seed at ``iter()`` (made with it), the sampler's order at the
    first index batch asked for (:meth:`plan`), and a RandomSampler's later
    permutations only as its index batches are asked for (:meth:`ask`), so an
    epoch left early (a peek, a ``break``) leaves the generator where torch's
    leaves it. Any other sampler's whole plan is drawn at once, every random
    generator then put back, and a second iterator of the sampler (``pacer``)
    drawn again as torch would ask it. ``drawn``: a resumed epoch's draws
    already made; ``end``: the loader's generator's state once an explicit
    plan's sampler ran out (a resumed explicit plan has no pacer: it sets
    that state when it runs out)."""

    def __init__(self, plans: "EpochPlans", base_seed: int, indices: Any = None, pacer: Any = None,
                 sampler: dpb.SamplerSpec | None = None, drawn: int = 0, end: Any = None) -> None:
        self._plans, self.base_seed, self._indices, self._pacer = plans, base_seed, indices, pacer
        self._spec, self.drawn, self.end = sampler, drawn, end
        self._generator: Any = None  # what a described RandomSampler draws from, as the batches are asked for
        self._resumed_end = False  # a resumed explicit plan: sets ``end`` once it runs out

    def plan(self) -> Drawn:
        """The epoch's plan, drawn now; the consumer's j-th sample is at place
        k + j*N (DistributedSampler's are its own positions)."""
        plans = self._plans
        if plans._plan is None:  # as torch: a base seed per epoch, no sampler
            return Drawn(self.base_seed, None, [], plans._num_streams)
        sampler = samplers.describe(plans._plan) if plans._compact else None
        if sampler is not None:
            sampler.place_offset, sampler.place_stride = plans.consumer_index, plans.num_consumers
            self._spec, self._generator = sampler, getattr(plans._plan.sampler, "generator", None)
            return Drawn(self.base_seed, sampler, [], 0)
        before = _Randomness(plans._plan)
        batches = [index_batch(b, plans._unbatched) for b in self._indices]
        if plans.generator is not None:
            self.end = plans.generator.get_state()
        before.restore()  # the pacer draws again, as torch's iterator would ask
        if plans._reproducible:
            samplers.place_explicit(batches, plans.consumer_index, plans.num_consumers)
        return Drawn(self.base_seed, None, batches, 0)

    def resume(self, generator: Any) -> None:
        """A resumed epoch goes on drawing from ``generator`` (restored as it was saved)."""
        if self._spec is not None and samplers.draw_calls(self._spec, 1):
            self._generator = generator
        self._resumed_end = self._spec is None and self.end is not None and generator is not None

    def ask(self, requested: int) -> None:
        """torch's iterator has now asked its sampler for ``requested`` index
        batches (past the last: it ran out): the draws that takes are made."""
        while self._pacer is not None and self.drawn < requested:
            self.drawn += 1
            if next(self._pacer, _END) is _END:
                self._pacer = None
        if self._resumed_end and requested > len(self._plans):
            self._resumed_end = False
            self._plans.generator.set_state(self.end)
        if self._generator is None:
            return
        due = samplers.draw_calls(self._spec, requested)
        while self.drawn < due:
            samplers.draw_call(self._spec, self._generator, self.drawn)
            self.drawn += 1


def coordinated(lengths: Any, dataset: Any, opts: Any, sampler: Any, batch_sampler: Any) -> tuple:
    """Coordinated reads for this consumer of the job: (dataset, batch_size, drop_last, batch_sampler).
    A map-style dataset gets a batch sampler (dpex.plan.buckets), ``lengths`` a length per sample
    or a function of a sample (evaluated here, on the trainer); an IterableDataset is bucketed on the
    fly in its streams by the function ``lengths`` (dpex.BucketedIterable)."""
    from dpex.plan.buckets import BucketBatchSampler, BucketedIterable
    if isinstance(dataset, tud.IterableDataset):
        if not callable(lengths) or opts.batch_size is None:
            raise DpexConfigError("lengths= with an IterableDataset: give a function of a sample (its length), "
                                  "and a batch_size")
        bucketed = BucketedIterable(dataset, lengths, opts.batch_size, seed=opts.seed or 0)
        return bucketed, opts.batch_size, opts.drop_last, batch_sampler
    if sampler is not None or batch_sampler is not None or opts.batch_size is None:
        raise DpexConfigError("lengths= (coordinated reads) plans the batches itself: give batch_size, "
                              "not a sampler or batch_sampler")
    if callable(lengths):
        if not isinstance(dataset, tud.Dataset):
            raise DpexConfigError("lengths as a function needs the dataset here, in the trainer; give a length "
                                  "per sample for one built on the workers, or build dpex.BucketedIterable there")
        lengths = [lengths(dataset[i]) for i in range(len(dataset))]
    return dataset, 1, False, BucketBatchSampler(lengths, opts.batch_size, num_replicas=opts.num_consumers,
                                                 rank=opts.consumer_index, seed=opts.seed or 0,
                                                 drop_last=opts.drop_last)


class EpochPlans:
    """Draws a loader's epochs, one per :meth:`begin` as torch's ``iter()``.

    A map-style dataset of ``length`` samples is planned by torch's own
    samplers; with ``distributed`` and no sampler, consumer k of N plans
    DistributedSampler's k-th share. An IterableDataset has no sampler: an
    epoch is a base seed for ``num_streams`` streams. ``compact`` sends
    torch's own samplers as descriptions (see dpex.plan.samplers). With
    ``persistent`` (torch's persistent workers) the base seed is drawn at
    the first ``iter()`` only, as torch's workers are seeded once; later
    epochs' seeds are derived from it (keyed draws differ per epoch)."""

    def __init__(self, length: int, iterable: bool, *, batch_size: int | None, drop_last: bool, shuffle: Any,
                 seed: int | None, sampler: Any, batch_sampler: Any, generator: Any, distributed: bool,
                 num_consumers: int, consumer_index: int, num_streams: int, compact: bool, unbatched: bool,
                 reproducible: bool, persistent: bool = False) -> None:
        self.length, self.iterable, self.batch_size, self.drop_last = length, iterable, batch_size, drop_last
        self.num_consumers, self.consumer_index = num_consumers, consumer_index
        self._generator, self._num_streams = generator, num_streams
        self._compact, self._unbatched, self._reproducible = compact, unbatched, reproducible
        self._persistent = persistent
        self.first_seed: tuple[int, int] | None = None  # persistent: (base seed, epoch) of the first iter()
        self._indices = Indices(length)
        self._plan: tud.DataLoader | None = None
        if iterable:
            check_iterable_args(shuffle, sampler, batch_sampler)
            return
        if length < 0:
            raise DpexConfigError("the dataset has no __len__; a map-style dataset needs one")
        if distributed and sampler is None and batch_sampler is None:
            sampler = tud.DistributedSampler(self._indices, num_replicas=num_consumers, rank=consumer_index,
                                             shuffle=bool(shuffle), seed=seed if seed is not None else 0)
            shuffle = False
        elif shuffle and sampler is None and generator is None and seed is not None:
            import torch
            generator = torch.Generator().manual_seed(seed)
        self._plan = tud.DataLoader(self._indices, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                                    batch_sampler=batch_sampler, drop_last=drop_last, collate_fn=_as_list,
                                    generator=generator)

    def __len__(self) -> int:
        """Batches per epoch, as ``len()`` of torch's DataLoader."""
        if self._plan is not None:
            return len(self._plan)
        if self.length < 0:  # as torch: an IterableDataset's len is the dataset's
            raise TypeError("the IterableDataset has no __len__")
        if self.batch_size is None:
            return self.length
        whole, part = divmod(self.length, self.batch_size)
        return whole if self.drop_last or not part else whole + 1

    def resize(self, length: int) -> None:
        """The dataset now has ``length`` samples: torch's samplers read the
        dataset's length at each epoch, and so read the stand-in's."""
        self.length = self._indices.length = length

    def set_epoch(self, epoch: int) -> None:
        """Forwards to samplers that have ``set_epoch`` (e.g. DistributedSampler)."""
        if self._plan is None:
            return
        for s in (self._plan.sampler, self._plan.batch_sampler, getattr(self._plan.batch_sampler, "sampler", None)):
            if hasattr(s, "set_epoch"):
                s.set_epoch(epoch)

    @property
    def generator(self) -> Any:
        """The generator epochs draw from: the user's, or the one ``seed`` made (None: torch's global RNG)."""
        return self._generator if self._generator is not None else getattr(self._plan, "generator", None)

    def describe_epoch(self, epoch: int) -> dpb.SamplerSpec:
        """The description of the epoch ``set_epoch(epoch)`` plans, of a sampler whose order
        follows the epoch alone (DistributedSampler, a seeded ShuffleSampler, a sequential one)."""
        plan = self._plan
        sampler = plan.sampler if plan is not None else None
        fixed = isinstance(sampler, tud.SequentialSampler) or (
            isinstance(sampler, (tud.DistributedSampler, shuffle.ShuffleSampler)) and hasattr(sampler, "set_epoch")
            and (not isinstance(sampler, shuffle.ShuffleSampler) or sampler.seed is not None))
        if not fixed or not samplers.describable(plan):
            raise DpexConfigError("only the epoch in progress has a plan to read: this loader's order is drawn "
                                  "anew each epoch (a RandomSampler, an unseeded or a user's sampler)")
        other = copy.copy(sampler)
        if hasattr(other, "set_epoch"):
            other.set_epoch(epoch)
        batch = plan.batch_sampler
        view = SimpleNamespace(sampler=other, batch_sampler=None if batch is None else tud.BatchSampler(
            other, batch.batch_size, batch.drop_last))
        spec = samplers.describe(view)
        spec.place_offset, spec.place_stride = self.consumer_index, self.num_consumers
        return spec

    def samplers(self) -> list[tuple[str, Any]]:
        """The planning loader's samplers, by the names a state dict keeps them under."""
        if self._plan is None:
            return []
        return [("sampler", self._plan.sampler), ("batch_sampler", self._plan.batch_sampler)]

    def begin(self, epoch: int) -> EpochDraw:
        """Epoch ``epoch`` as torch's ``iter()`` begins it: its base seed drawn
        (the loader's ``generator``, else torch's global RNG), its sampler not yet."""
        import torch
        # torch makes the sampler's iterator first (a sampler whose __iter__ draws at once draws first)
        index_sampler = None if self._plan is None else (
            self._plan.batch_sampler if self._plan.batch_sampler is not None else self._plan.sampler)
        indices = pacer = None
        if index_sampler is not None:
            before = _Randomness(self._plan)
            indices = iter(index_sampler)
            if not self._compact or not samplers.describable(self._plan):
                after = _Randomness(self._plan)
                before.restore()  # a sampler that draws at iter() draws the same again for the pacer
                pacer = iter(index_sampler)
                after.restore()
        if self._persistent and self.first_seed is not None:
            first, at = self.first_seed
            base_seed = first if epoch == at else seeding.for_epoch(first, epoch)
        else:
            generator = self._generator if self._plan is None else self._plan.generator
            base_seed = torch.empty((), dtype=torch.int64).random_(generator=generator).item()
            if self._persistent:
                self.first_seed = (base_seed, epoch)
        return EpochDraw(self, base_seed, indices, pacer)

    def resumed(self, base_seed: int, sampler: dpb.SamplerSpec | None, drawn: int, end: Any) -> EpochDraw:
        """A saved epoch, nothing drawn again but what torch's sampler had still to draw."""
        epoch = EpochDraw(self, base_seed, sampler=sampler, drawn=drawn, end=end)
        epoch.resume(self.generator)
        return epoch
