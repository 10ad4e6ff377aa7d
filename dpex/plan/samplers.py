"""torch's own samplers (and dpex.ShuffleSampler) as descriptions, and their
index batches computed from a description, bit-identical to what the
samplers yield.

The trainer runs :func:`describe` where torch would run the sampler: it
consumes the random numbers torch would consume (RandomSampler draws a seed
from torch's global RNG, or advances the user's generator) and returns a few
numbers instead of every index. Whoever needs a split's batches calls
:func:`batches`, which runs the same torch operations (``randperm``,
``randint``) on a generator in the same state. torch does not promise that
another version draws the same numbers, so a description carries the
trainer's torch version and one with another is refused (:func:`check_version`).

torch is imported on first use: a worker daemon that never expands a
description does not pay for it.
"""
from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from dpex.errors import DpexConfigError
from dpex.plan import shuffle
from dpex.proto import dispatcher_pb2 as dpb

Spec = dpb.SamplerSpec
_CACHED_ORDERS = 4  # epochs' orders a process keeps (current and next, of a few jobs)


def torch_version() -> str:
    """The torch release whose samplers this process runs ("2.13.0"; no build tag:
    CPU and CUDA wheels of a release draw the same numbers on the CPU generator):
    dpex.version's, which workers register with (the dispatcher routes by it),
    else (a torch without package metadata) the module's own."""
    from dpex import version
    if version.torch():
        return version.torch()
    import torch
    return torch.__version__.split("+")[0]


def check_version(spec: Spec) -> None:
    """Refuses a description made by another torch release (its samplers may
    differ), or a ShuffleSampler's made with another order than this one's."""
    if spec.kind == Spec.SHUFFLE:
        if spec.algorithm != shuffle.ALGORITHM:
            raise DpexConfigError(
                f"the trainer described this epoch's ShuffleSampler with the order {spec.algorithm!r}, but this "
                f"worker computes {shuffle.ALGORITHM!r}; install the same dpex release on trainers and workers")
        return
    mine = torch_version()
    if spec.torch_version != mine:
        raise DpexConfigError(
            f"the trainer described this epoch's sampler with torch {spec.torch_version}, but this worker "
            f"has torch {mine}, whose samplers may draw other indices; install the same torch release "
            "on trainers and workers")


# ---- the trainer's side ---------------------------------------------------------------------
def describable(loader: Any) -> bool:
    """Whether :func:`describe` describes the loader's sampler (one of torch's own, or dpex.ShuffleSampler)."""
    import torch.utils.data as tud
    batch_sampler, sampler = loader.batch_sampler, loader.sampler
    if batch_sampler is not None and (type(batch_sampler) is not tud.BatchSampler
                                      or batch_sampler.sampler is not sampler):
        return False
    kind = type(sampler)
    if kind is tud.RandomSampler and sampler.generator is not None and sampler.generator.device.type != "cpu":
        return False
    return kind in (shuffle.ShuffleSampler, tud.SequentialSampler, tud.RandomSampler, tud.DistributedSampler)


def describe(loader: Any) -> Spec | None:
    """The description of the epoch ``iter(loader)`` would plan next, for a
    DataLoader whose iterator was just made (its base seed drawn); None when
    its sampler is not one of torch's own (the caller then iterates it).
    A RandomSampler without a generator draws its seed from torch's global
    RNG, as torch's does at its first index; one with a generator is
    described by its state, and drawn from as its batches are asked for
    (:func:`draw_calls`)."""
    import torch.utils.data as tud
    if not describable(loader):
        return None
    batch_sampler, sampler = loader.batch_sampler, loader.sampler
    if batch_sampler is None:  # batch_size=None: each element is a batch of one (the job says unbatched)
        batch_size, drop_last = 1, False
    else:
        batch_size, drop_last = batch_sampler.batch_size, batch_sampler.drop_last
    kind = type(sampler)
    if kind is shuffle.ShuffleSampler:  # the seed its iter() would take (or draw). No torch_version:
        # a worker of a release without SHUFFLE then refuses it rather than reading another kind.
        return Spec(kind=Spec.SHUFFLE, algorithm=shuffle.ALGORITHM, length=sampler.length,
                    batch_size=batch_size, drop_last=drop_last, seed=sampler.epoch_seed(), num_replicas=sampler.num_replicas, rank=sampler.rank,
                    sampler_drop_last=sampler.drop_last)
    # The indices are positions in the sampler's own data source, which need not be the dataset.
    source = sampler.dataset if kind is tud.DistributedSampler else sampler.data_source
    spec = Spec(torch_version=torch_version(), length=len(source), batch_size=batch_size, drop_last=drop_last)
    if kind is tud.SequentialSampler:
        spec.kind = Spec.SEQUENTIAL
    elif kind is tud.RandomSampler:
        import torch
        spec.kind = Spec.RANDOM
        spec.replacement, spec.num_samples = sampler.replacement, sampler.num_samples
        if sampler.generator is None:  # as RandomSampler.__iter__: a seed from the global RNG
            spec.seed = int(torch.empty((), dtype=torch.int64).random_().item())
        else:
            # The user's generator is drawn from later, as torch's iterator draws (see draw_calls).
            spec.generator_state = zlib.compress(sampler.generator.get_state().numpy().tobytes())
    elif kind is tud.DistributedSampler:
        spec.kind = Spec.DISTRIBUTED
        spec.seed, spec.shuffle = sampler.seed + sampler.epoch, sampler.shuffle
        spec.num_replicas, spec.rank, spec.sampler_drop_last = (sampler.num_replicas, sampler.rank,
                                                                sampler.drop_last)
    return spec


# ---- sizes ------------------------------------------------------------------------------------
def num_samples(spec: Spec) -> int:
    """len(sampler)."""
    return _KINDS[spec.kind].num_samples(spec)


def validate(spec: Spec) -> None:
    """Refuses a description no sampler makes (a bad client's)."""
    if spec.kind not in _KINDS:
        raise DpexConfigError(f"a plan describes a sampler of unknown kind {spec.kind}")
    if spec.batch_size < 1:
        raise DpexConfigError(f"a plan describes batches of {spec.batch_size} samples")
    if _KINDS[spec.kind].sharded and not spec.rank < spec.num_replicas:
        raise DpexConfigError(f"a plan describes rank {spec.rank} of {spec.num_replicas} replicas")


def num_batches(spec: Spec) -> int:
    """len(batch_sampler)."""
    whole, part = divmod(num_samples(spec), spec.batch_size)
    return whole if spec.drop_last or not part else whole + 1


# ---- whoever needs a split's batches ----------------------------------------------------------
def draws_order(spec: Spec) -> bool:
    """Whether a split's batches need the epoch's whole permutation drawn first
    (O(length) time and memory, once per process and epoch)."""
    return _KINDS[spec.kind].draws_order(spec)


def _span(spec: Spec, first: int, count: int) -> tuple[int, int]:
    """The sampler positions ``start`` .. ``stop - 1`` that batches ``first``
    .. ``first + count - 1`` take (BatchSampler's cut, its drop_last)."""
    total = num_samples(spec)
    size = spec.batch_size
    start, stop = first * size, min(total, (first + count) * size)
    if spec.drop_last:
        stop = min(stop, (total // size) * size)
    return start, stop


def batches(spec: Spec, first: int, count: int) -> list[list[int]]:
    """Index batches ``first`` .. ``first + count - 1`` of the described epoch."""
    check_version(spec)
    size = spec.batch_size
    start, stop = _span(spec, first, count)
    if start >= stop:
        return []
    flat = _KINDS[spec.kind].indices(spec, start, stop)
    return [flat[i:i + size] for i in range(0, len(flat), size)]


def every_rank(spec: Spec, seq: int, own: int) -> dict[int, list[int]]:
    """Batch ``seq`` of every rank the description shards the epoch among (rank: its indices), or of
    consumer ``own`` alone when it shards nothing. A rank whose epoch is shorter has none."""
    if not _KINDS[spec.kind].sharded:
        got = batches(spec, seq, 1)
        return {own: got[0]} if got else {}
    out = {}
    for rank in range(spec.num_replicas):
        other = Spec()
        other.CopyFrom(spec)
        other.rank = rank
        got = batches(other, seq, 1)
        if got:
            out[rank] = got[0]
    return out


def places(spec: Spec, first: int, count: int) -> list[list[int]]:
    """The places of the samples of batches ``first`` .. ``first + count - 1``
    (what their random draws are keyed by, dpex.seeding): DistributedSampler's
    and ShuffleSampler's padded positions (``rank + j * num_replicas``, the
    same for a sample whatever the number of ranks), else
    ``place_offset + j * place_stride`` for the consumer's j-th sample."""
    size = spec.batch_size
    start, stop = _span(spec, first, count)
    if _KINDS[spec.kind].sharded:
        offset, stride = spec.rank, spec.num_replicas
    else:
        offset, stride = spec.place_offset, max(1, spec.place_stride)
    flat = [offset + j * stride for j in range(start, stop)]
    return [flat[i:i + size] for i in range(0, len(flat), size)]


def place_explicit(batches: list[dpb.IndexBatch], offset: int, stride: int) -> None:
    """Sets the places of an explicit plan's batches (a sampler Dpex cannot
    describe): the consumer's j-th sample (or whole element) is at
    ``offset + j * stride``, as in :func:`places`."""
    j = 0
    for batch in batches:
        n = 1 if batch.whole else len(batch.indices)
        batch.places[:] = range(offset + j * stride, offset + (j + n) * stride, stride)
        j += n


def _distributed(spec: Spec, start: int, stop: int) -> list[int]:
    # DistributedSampler pads (or cuts) the order to total_size, padded[i] =
    # order[i % n], and takes every num_replicas-th from rank: its j-th index
    # is order[(rank + j * num_replicas) % n].
    import torch
    where = shuffle.positions(spec.length, spec.num_replicas, spec.rank, start, stop)
    if not spec.shuffle:
        return where.tolist()
    return _order(spec)[torch.from_numpy(where)].tolist()


_cache: OrderedDict[bytes, Any] = OrderedDict()
_cache_lock = threading.Lock()
_computing: dict[bytes, threading.Lock] = {}


def order_key(spec: Spec) -> bytes:
    """Equal for descriptions that share one drawn order (a DistributedSampler's
    ranks; the splits of an epoch)."""
    return Spec(kind=spec.kind, length=spec.length, replacement=spec.replacement, num_samples=spec.num_samples,
                seed=spec.seed, generator_state=spec.generator_state,
                shuffle=spec.shuffle).SerializeToString(deterministic=True)


def _order(spec: Spec) -> Any:
    """The whole sampler order of a random description (the shared permutation
    of a DistributedSampler's ranks), computed once per process and epoch."""
    key = order_key(spec)
    with _cache_lock:
        if key in _cache:
            _cache.move_to_end(key)
            return _cache[key]
        lock = _computing.setdefault(key, threading.Lock())
    with lock:  # one thread computes it; the others wait for it
        with _cache_lock:
            if key in _cache:
                return _cache[key]
        order = _compute(spec)
        with _cache_lock:
            _cache[key] = order
            _computing.pop(key, None)
            while len(_cache) > _CACHED_ORDERS:
                _cache.popitem(last=False)
        return order


def _generator(spec: Spec) -> Any:
    import torch
    g = torch.Generator()
    if spec.generator_state:
        state = torch.frombuffer(bytearray(zlib.decompress(spec.generator_state)), dtype=torch.uint8)
        g.set_state(state)
    else:
        g.manual_seed(spec.seed)
    return g


def _compute(spec: Spec) -> Any:
    import torch
    if spec.kind == Spec.DISTRIBUTED:  # DistributedSampler: randperm of a generator seeded seed + epoch
        return torch.randperm(spec.length, generator=_generator(spec))
    return _draw(spec, _generator(spec))


def _draw(spec: Spec, generator: Any) -> Any:
    """RandomSampler's order from ``generator``, as one tensor (torch draws the
    same numbers in one call as in its chunks of 32; tests/unit/test_samplers.py):
    only the permutations that the order uses."""
    import torch
    n, total = spec.length, spec.num_samples
    if spec.replacement:
        return torch.randint(high=n, size=(total,), dtype=torch.int64, generator=generator)
    perms = [torch.randperm(n, generator=generator) for _ in range(-(-total // n))]
    return torch.cat(perms)[:total] if len(perms) > 1 else perms[0][:total]


def draw_calls(spec: Spec, requested: int) -> int:
    """How many times a RandomSampler of ``spec`` (with a generator of its
    own) has drawn from it once its BatchSampler was asked for ``requested``
    index batches: torch draws each permutation (or chunk of 32 with
    replacement) when its first index is needed, and one more (partial, or
    empty and still drawn) when the sampler runs out."""
    if spec.kind != Spec.RANDOM or not spec.generator_state or requested <= 0:
        return 0
    total = spec.num_samples
    chunk = 32 if spec.replacement else max(1, spec.length)
    if requested * spec.batch_size > total:  # asked past its end: the sampler ran out
        return total // chunk + 1
    return -(-requested * spec.batch_size // chunk)


def draw_call(spec: Spec, generator: Any, k: int) -> None:
    """Makes RandomSampler's draw number ``k`` (from 0) on ``generator``, as torch makes it."""
    import torch
    total = spec.num_samples
    if spec.replacement:
        size = 32 if k < total // 32 else total % 32
        torch.randint(high=spec.length, size=(size,), dtype=torch.int64, generator=generator)
    else:
        torch.randperm(spec.length, generator=generator)


# ---- the kinds ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Kind:
    """What a described sampler's kind means, in one place.

    ``sharded``: the sampler takes one rank's share of the dataset, sample j
    of rank r at position ``r + j * num_replicas`` of a padded order (its
    place, the same whatever the number of ranks: dpex.seeding); otherwise a
    consumer plans the whole order, its j-th sample placed at
    ``place_offset + j * place_stride``. ``num_samples``: len(sampler).
    ``indices``: positions start..stop-1 of the sampler's order.
    ``draws_order``: a split needs the epoch's whole permutation drawn first."""
    sharded: bool
    num_samples: Callable[[Spec], int]
    indices: Callable[[Spec, int, int], list[int]]
    draws_order: Callable[[Spec], bool]


def _shard_size(spec: Spec) -> int:
    return shuffle.num_samples(spec.length, spec.num_replicas, spec.sampler_drop_last)


_KINDS: dict[int, Kind] = {
    Spec.SEQUENTIAL: Kind(sharded=False, num_samples=lambda spec: spec.length,
                          indices=lambda spec, start, stop: list(range(start, stop)),
                          draws_order=lambda spec: False),
    Spec.RANDOM: Kind(sharded=False, num_samples=lambda spec: spec.num_samples,
                      indices=lambda spec, start, stop: _order(spec)[start:stop].tolist(),
                      draws_order=lambda spec: True),
    Spec.DISTRIBUTED: Kind(sharded=True, num_samples=_shard_size, indices=lambda spec, start, stop:
                           _distributed(spec, start, stop), draws_order=lambda spec: spec.shuffle),
    Spec.SHUFFLE: Kind(sharded=True, num_samples=_shard_size, indices=lambda spec, start, stop: shuffle.indices(
                       spec.length, spec.seed, spec.num_replicas, spec.rank, start, stop).tolist(),
                       draws_order=lambda spec: False),
}
