"""DpexDataLoader: the drop-in for torch.utils.data.DataLoader, with the
signature of the original (Ray-based) Dpex.

``distribute_mode=False`` returns torch's own DataLoader, built from the same
arguments. ``distribute_mode=True`` runs loading on Dpex workers through a
RemoteDataLoader and keeps torch's semantics for everything else.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, TypeVar

from torch.utils.data import DataLoader, IterableDataset

from dpex.client.loader import RemoteDataLoader, _rebuild
from dpex.client.sampling import Indices
from dpex.dataset import DatasetSpec
from dpex.client.stats import LoaderStats
from dpex.errors import DpexTimeoutError, warn
from dpex.torch_private import iterable_len_asked

_T_co = TypeVar("_T_co", covariant=True)


class _Epoch:
    """An epoch's iterator, as torch's: it holds its loader, says what
    torch's says on a timeout and when an IterableDataset yields more than
    its ``len()`` said, and is an iterator (not a generator) so that a loop
    may catch a worker's exception and go on to the next batch."""

    def __init__(self, loader: "DpexDataLoader", epoch: Iterator[Any]) -> None:
        self._loader = loader  # as torch's iterator: the loader lives while its epoch does
        self._epoch = epoch
        self._reported = iterable_len_asked(loader)  # len(loader) of an IterableDataset, if asked
        self._yielded = 0

    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Any:
        try:
            batch = next(self._epoch)
        except DpexTimeoutError as e:
            raise RuntimeError(f"DataLoader timed out after {self._loader.timeout} seconds") from e
        self._yielded += 1
        if self._reported is not None and self._yielded > self._reported:
            warn_msg = (f"Length of IterableDataset {self._loader.dataset} was reported to be {self._reported}"
                        f"(when accessing len(dataloader)), but {self._yielded} samples have been fetched. ")
            if self._loader.num_workers > 0:
                warn_msg += ("For multiprocessing data-loading, this could be caused by not properly configuring "
                             "the IterableDataset replica at each worker. Please see "
                             "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset "
                             "for examples.")
            warn(warn_msg)
        return batch

    def __len__(self) -> int:
        return len(self._loader)


class _Stream(IterableDataset):
    """Stands in for an IterableDataset that a DatasetSpec builds on the workers."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        if self.length < 0:
            raise TypeError("the IterableDataset has no __len__")
        return self.length

    def __iter__(self) -> Iterator[Any]:
        raise TypeError("iterated on the workers")


ACCELERATE_REBUILDS = (
    "accelerator.prepare() rebuilds this DpexDataLoader as torch's DataLoader: torch's worker processes would make "
    "its batches here in the trainer, not Dpex's workers. Prepare it with "
    "dpex.accelerate.prepare_data_loader(accelerator, loader), and only the model and optimizer with "
    "accelerator.prepare (docs/guides/accelerate.md).")


_DPEX_ONLY = ("reproducible", "share", "cache", "even_batches", "lengths")  # DpexDataLoader's arguments that torch's lacks


class DpexDataLoader(DataLoader[_T_co]):
    """``DataLoader(...)`` → ``DpexDataLoader(..., distribute_mode=True)``.

    In distribute mode it is a ``torch.utils.data.DataLoader`` (built by torch's own constructor, so its
    checks, messages, attributes and ``len()`` are torch's) whose batches Dpex workers make. Every argument
    stays on the instance under its name, so a rebuild from the attributes (Lightning) is a Dpex loader
    again, and a pickled loader is a new one of the same arguments where it is unpickled;
    ``dispatcher_address`` is the dispatcher it chose. The arguments torch has mean what they mean in
    torch; ``worker_init_fn``, ``get_worker_info()`` and per-process seeds run on the workers as in
    torch's worker processes.

    Args:
        dataset: a map-style or iterable dataset, shipped to the workers by value (a ``dpex.DatasetSpec``
            with ``RemoteDataLoader`` for large ones).
        distribute_mode: False: torch's own ``DataLoader`` is returned (Dpex's own arguments dropped).
        head_address: where loading runs: ``"auto"`` is ``$DPEX_DISPATCHER``, else the Ray cluster this
            machine belongs to (:mod:`dpex.ray`), else an embedded cluster of ``num_workers`` processes;
            ``"ray://HOST:PORT"`` or a Ray head's ``HOST:6379``: that Ray cluster; ``"dpex://HOST:PORT"``
            or another ``HOST:PORT``: a Dpex dispatcher (dpex.launch.head).
        batch_size: as torch's (None: no auto-batching).
        shuffle: as torch's.
        sampler: as torch's.
        batch_sampler: as torch's.
        num_workers: the worker processes the job asks for (an embedded cluster's size; an
            IterableDataset's streams).
        collate_fn: as torch's, run on the workers.
        pin_memory: as torch's.
        drop_last: as torch's.
        timeout: as torch's: 0 waits as long as it takes.
        worker_init_fn: as torch's, run on the workers.
        multiprocessing_context: checked as torch checks it; ``"fork"`` (the default on Linux) forks an
            embedded cluster's processes from the trainer, as torch's workers are, else spawned.
        generator: as torch's: drives the shuffle and the base seed.
        prefetch_factor: as torch's; with ``num_workers`` it sets how many batches are requested ahead.
        persistent_workers: as torch's.
        in_order: as torch's.
        pin_memory_device: as torch's.
        reproducible: Dpex's own: a sample's random draws keyed by the epoch's base seed and its place in
            the plan, not by the process that makes it (``RemoteDataLoader``).
        share: Dpex's own: jobs of an equal definition make each batch once.
        cache: Dpex's own: ``"memory"`` or ``"disk"`` keeps the samples on the workers across epochs.
        even_batches: Dpex's own, as Accelerate's: ``"shortest"`` or ``"longest"`` gives every DDP rank
            the same number of batches.
        lengths: Dpex's own: coordinated reads (``RemoteDataLoader``).

    Raises:
        ValueError: an argument torch refuses, in torch's words.
        DpexConfigError: an argument Dpex refuses.
    """

    def __new__(cls, dataset: Any, distribute_mode: bool = False, head_address: str | None = "auto",
                *args: Any, **kwargs: Any) -> Any:
        if not distribute_mode:  # the rest of the signature is torch's, in torch's order; Dpex's own
            for name in _DPEX_ONLY:  # settings of the distributed loader mean nothing to torch's
                kwargs.pop(name, None)
            return DataLoader(dataset, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, dataset: Any, distribute_mode: bool = False, head_address: str | None = "auto",
                 batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 prefetch_factor: int | None = None, persistent_workers: bool = False,
                 in_order: bool = True, pin_memory_device: str = "", reproducible: bool = True,
                 share: bool = True, cache: str | None = None, even_batches: bool | str | None = False,
                 lengths: Any = None) -> None:
        # Every argument as given, for a rebuild from the instance (Lightning reads the attributes named as
        # __init__'s parameters) and for pickling (a spawned rank builds its own loader from them).
        self._init_args = dict(
            dataset=dataset, distribute_mode=distribute_mode, head_address=head_address, batch_size=batch_size,
            shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler, num_workers=num_workers,
            collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context, generator=generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, in_order=in_order,
            pin_memory_device=pin_memory_device, reproducible=reproducible, share=share, cache=cache,
            even_batches=even_batches, lengths=lengths)
        # torch reorders only across its worker processes: with one or none, in_order=False yields in order.
        common = dict(drop_last=drop_last, collate_fn=collate_fn, ordered=in_order or num_workers <= 1,
                      timeout=timeout or None,
                      generator=generator, window=(prefetch_factor or 2) * max(1, num_workers),
                      worker_init_fn=worker_init_fn, persistent_workers=persistent_workers, pin_memory=pin_memory,
                      pin_memory_device=pin_memory_device, num_workers=num_workers,
                      processes=max(1, num_workers),
                      shard=False,  # as torch's DataLoader: only a sampler the user gives shards under DDP
                      multiprocessing_context=multiprocessing_context, reproducible=reproducible, share=share,
                      cache=cache, even_batches=even_batches, lengths=lengths, **({"prefetch_factor": prefetch_factor} if prefetch_factor else {}))
        address = "auto" if head_address is None else head_address
        torch_args = dict(batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
                          num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
                          drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                          multiprocessing_context=multiprocessing_context, generator=generator,
                          prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                          pin_memory_device=pin_memory_device, in_order=in_order)
        if isinstance(dataset, DatasetSpec):  # built on the workers: torch's constructor sees a stand-in of its size
            self._remote = RemoteDataLoader(address, dataset, batch_size=batch_size, shuffle=bool(shuffle),
                                            sampler=sampler, batch_sampler=batch_sampler, **common)
            remote = self._remote
            plans = remote._epochs.plans
            super().__init__(_Stream(plans.length) if plans.iterable else Indices(plans.length), **torch_args)
            object.__setattr__(self, "dataset", dataset)  # past torch's guard: the spec is the dataset
            self._keep_dpex_args()
            return
        # torch's own constructor: its checks with its words, its attributes.
        super().__init__(dataset, **torch_args)
        iterable = isinstance(dataset, IterableDataset)
        # Planned by this loader's own sampler, as torch plans: one sampler, which follows the dataset.
        plan: dict[str, Any] = ({} if iterable else dict(batch_sampler=batch_sampler) if batch_sampler is not None
                                else dict(sampler=self.sampler, batch_size=self.batch_size))
        # Past a framework's __setattr__ (see _framework_record): Lightning would set this loader's
        # RemoteDataLoader again on the loader it rebuilds, which then planned with the old sampler.
        object.__setattr__(self, "_remote", RemoteDataLoader(
            address, dataset, batch_size=self.batch_size if iterable else plan.pop("batch_size", 1),
            **common, **plan))
        self._keep_dpex_args()

    def _keep_dpex_args(self) -> None:
        """Dpex's own arguments as instance attributes, as torch keeps its own,
        and in a framework's record of the arguments (see _framework_record)."""
        for name in ("distribute_mode", "head_address", "reproducible", "share", "cache"):
            object.__setattr__(self, name, self._init_args[name])
        _framework_record(self)

    @property
    def _is_accelerate_prepared(self) -> bool:
        """Accelerate's mark of a loader it prepared, which
        ``accelerator.prepare`` reads before it rebuilds the loader as torch's
        DataLoader: the one moment to tell the user, unless dpex.accelerate
        prepares it (and keeps Dpex making the batches)."""
        if not self.__dict__.get("_prepared_by_dpex"):
            warn(ACCELERATE_REBUILDS)
        return self.__dict__.get("_accelerate_prepared", False)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = value

    @property
    def dispatcher_address(self) -> str:
        """The dispatcher it chose (an embedded cluster's: once it serves)."""
        return self._remote.address

    def __reduce__(self) -> Any:
        """Pickles to its arguments: unpickled (say, in a spawned rank) it is a
        new loader of them, which reaches the same dispatcher, or (``"auto"``
        without one) that process's own embedded cluster."""
        return _rebuild, (type(self), self._init_args)

    def set_epoch(self, epoch: int) -> None:
        """See :meth:`RemoteDataLoader.set_epoch`.

        Args:
            epoch: the epoch the next ``iter()`` plans."""
        self._remote.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self.num_workers > 0 and self._remote.embedded:
            self.check_worker_number_rationality()  # its processes run on this machine, as torch's would
        return _Epoch(self, iter(self._remote))

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`RemoteDataLoader.state_dict` (torchdata's StatefulDataLoader usage)."""
        return self._remote.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """See :meth:`RemoteDataLoader.load_state_dict`.

        Args:
            state_dict: one state dict, or under DDP every rank's, as a list."""
        self._remote.load_state_dict(state_dict)

    def stats(self, reset: bool = False) -> LoaderStats:
        """See :meth:`RemoteDataLoader.stats`.

        Args:
            reset: start a new window after this one.
        Returns:
            The window's :class:`LoaderStats`."""
        return self._remote.stats(reset)

    def close(self) -> None:
        """Stops streams and, with an embedded cluster, its processes."""
        self._remote.close()

    def __enter__(self) -> "DpexDataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()



# Lightning (lightning_fabric.utilities.data._wrap_init_method), while a *_dataloader hook runs, records on
# each DataLoader the arguments of the outermost __init__ it patched, to rebuild it with a sampler of its
# own, and the attributes set outside that __init__, which it sets again on the rebuilt loader. A class
# imported inside the hook (``import dpex`` there) is not patched: torch's own __init__ then records
# torch's arguments, without distribute_mode (the rebuild was torch's DataLoader), and what DpexDataLoader
# sets after it counts as set from outside. The one reach into Lightning's private record;
# tests/integration/test_lightning.py fails if it changes.
_LIGHTNING_RECORD = ("__pl_saved_args", "__pl_saved_kwargs", "__pl_saved_arg_names")


def _framework_record(loader: "DpexDataLoader") -> None:
    """Puts Dpex's arguments into a record that torch's __init__ made."""
    kwargs = getattr(loader, _LIGHTNING_RECORD[1], None)
    if not isinstance(kwargs, dict) or "distribute_mode" in kwargs:
        return  # none, or made by DpexDataLoader.__init__ itself
    for name, value in zip(_LIGHTNING_RECORD, ((), dict(loader._init_args), ())):
        object.__setattr__(loader, name, value)
