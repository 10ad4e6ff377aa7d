"""A loader's epochs as torch plans them: torch's own samplers, driven by a
DataLoader over indices exactly as torch.utils.data.DataLoader drives them,
so that the same seed draws the same batches; torch's checks, with its words."""
from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import torch.utils.data as tud

from dpex.errors import DpexConfigError
from dpex.plan import samplers
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


def _as_list(indices: list[int]) -> list[int]:
    return indices


class Drawn(NamedTuple):
    """One epoch's plan: its base seed, and a sampler's description, explicit
    index batches, or (an IterableDataset) the number of streams."""
    base_seed: int
    sampler: dpb.SamplerSpec | None
    batches: list[dpb.IndexBatch]
    streams: int


class EpochPlans:
    """Draws a loader's epochs, one per ``draw()`` as torch's ``iter()``.

    A map-style dataset of ``length`` samples is planned by torch's own
    samplers; with ``distributed`` and no sampler, consumer k of N plans
    DistributedSampler's k-th share. An IterableDataset has no sampler: an
    epoch is a base seed for ``num_streams`` streams. ``compact`` sends
    torch's own samplers as descriptions (see dpex.plan.samplers)."""

    def __init__(self, length: int, iterable: bool, *, batch_size: int | None, drop_last: bool, shuffle: Any,
                 seed: int | None, sampler: Any, batch_sampler: Any, generator: Any, distributed: bool,
                 num_consumers: int, consumer_index: int, num_streams: int, compact: bool, unbatched: bool,
                 reproducible: bool) -> None:
        self.length, self.iterable, self.batch_size, self.drop_last = length, iterable, batch_size, drop_last
        self.num_consumers, self.consumer_index = num_consumers, consumer_index
        self._generator, self._num_streams = generator, num_streams
        self._compact, self._unbatched, self._reproducible = compact, unbatched, reproducible
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

    def samplers(self) -> list[tuple[str, Any]]:
        """The planning loader's samplers, by the names a state dict keeps them under."""
        if self._plan is None:
            return []
        return [("sampler", self._plan.sampler), ("batch_sampler", self._plan.batch_sampler)]

    def draw(self) -> Drawn:
        """The next epoch's plan; the consumer's j-th sample is at place
        k + j*N (DistributedSampler's are its own positions)."""
        import torch
        if self._plan is None:  # as torch: a base seed per epoch, no sampler
            base_seed = torch.empty((), dtype=torch.int64).random_(generator=self._generator).item()
            return Drawn(base_seed, None, [], self._num_streams)
        indices = iter(self._plan)  # torch's own iterator draws the epoch's base seed, then runs the sampler
        sampler = samplers.describe(self._plan) if self._compact else None
        if sampler is not None:
            sampler.place_offset, sampler.place_stride = self.consumer_index, self.num_consumers
            return Drawn(indices._base_seed, sampler, [], 0)
        batches = [index_batch(b, self._unbatched) for b in indices]
        if self._reproducible:
            samplers.place_explicit(batches, self.consumer_index, self.num_consumers)
        return Drawn(indices._base_seed, None, batches, 0)
