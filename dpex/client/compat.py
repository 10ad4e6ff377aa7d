"""DpexDataLoader: the drop-in for torch.utils.data.DataLoader, with the
signature of the original (Ray-based) Dpex.

``distribute_mode=False`` returns torch's own DataLoader, built from the same
arguments. ``distribute_mode=True`` runs loading on Dpex workers through a
RemoteDataLoader and keeps torch's semantics for everything else.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import DataLoader

from dpex.client.loader import RemoteDataLoader
from dpex.client.stats import LoaderStats
from dpex.errors import DpexConfigError, DpexTimeoutError


class DpexDataLoader:
    """``DataLoader(...)`` → ``DpexDataLoader(..., distribute_mode=True)``.

    In distribute mode, ``head_address`` says where loading runs:
    ``"auto"`` is ``$DPEX_DISPATCHER``, else the Ray cluster this machine
    belongs to (Dpex started on it, see :mod:`dpex.ray`), else an embedded
    cluster of ``num_workers`` processes; ``"ray://HOST:PORT"`` or a Ray
    head's ``HOST:6379`` is that Ray cluster; ``"dpex://HOST:PORT"`` or
    another ``HOST:PORT`` is a Dpex dispatcher (see ``dpex.launch.head``);
    ``num_workers`` is how many worker processes the job asks for (and, with
    ``prefetch_factor``, how many batches are requested ahead); the dataset
    instance is shipped to the workers by value (see ``dpex.DatasetSpec`` for
    large datasets). ``worker_init_fn``, ``get_worker_info()``, per-process
    seeds, ``generator``, ``timeout``, ``pin_memory``, ``in_order`` and
    ``persistent_workers`` behave as in torch.
    """

    def __new__(cls, dataset: Any, distribute_mode: bool = False, head_address: str | None = "auto",
                batch_size: int | None = 1, shuffle: bool | None = None, sampler: Any = None,
                batch_sampler: Any = None, num_workers: int = 0,
                collate_fn: Callable[[list], Any] | None = None, pin_memory: bool = False,
                drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                multiprocessing_context: Any = None, generator: Any = None, *,
                prefetch_factor: int | None = None, persistent_workers: bool = False,
                in_order: bool = True, pin_memory_device: str = "", **kwargs: Any) -> Any:
        if not distribute_mode:
            return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                              batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                              pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                              worker_init_fn=worker_init_fn,
                              multiprocessing_context=multiprocessing_context, generator=generator,
                              prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
                              pin_memory_device=pin_memory_device, in_order=in_order, **kwargs)
        self = super().__new__(cls)
        self._start(dataset, head_address, batch_size, shuffle, sampler, batch_sampler, num_workers,
                    collate_fn, pin_memory, drop_last, timeout, worker_init_fn, multiprocessing_context,
                    generator, prefetch_factor, persistent_workers, in_order, pin_memory_device, kwargs)
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Everything is done in __new__, which may return torch's DataLoader instead."""

    def _start(self, dataset: Any, head_address: str | None, batch_size: int | None, shuffle: bool | None,
               sampler: Any, batch_sampler: Any, num_workers: int, collate_fn: Any, pin_memory: bool,
               drop_last: bool, timeout: float, worker_init_fn: Any, multiprocessing_context: Any,
               generator: Any, prefetch_factor: int | None, persistent_workers: bool, in_order: bool,
               pin_memory_device: str, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise TypeError(f"DpexDataLoader got unexpected arguments: {', '.join(kwargs)}")
        if num_workers < 0:
            raise ValueError("num_workers option should be non-negative; use num_workers=0 to disable multiprocessing.")
        if timeout < 0:
            raise ValueError("timeout option should be non-negative")
        start = multiprocessing_context
        if start is not None and getattr(start, "get_start_method", lambda: start)() != "spawn":
            raise DpexConfigError("Dpex worker processes are always spawned; multiprocessing_context "
                                  "must be None or 'spawn' with distribute_mode=True")
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.prefetch_factor = 2 if prefetch_factor is None else prefetch_factor
        self.timeout = timeout
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.in_order = in_order
        self._remote = RemoteDataLoader(
            "auto" if head_address is None else head_address, dataset, batch_size=batch_size,
            shuffle=bool(shuffle), drop_last=drop_last,
            sampler=sampler, batch_sampler=batch_sampler, collate_fn=collate_fn, ordered=in_order,
            timeout=timeout or None, generator=generator,
            window=self.prefetch_factor * max(1, num_workers), worker_init_fn=worker_init_fn,
            persistent_workers=persistent_workers, pin_memory=pin_memory, pin_memory_device=pin_memory_device,
            num_workers=max(1, num_workers), processes=max(1, num_workers),
            shard=False)  # as torch's DataLoader: only a sampler the user gives shards under DDP
        self.head_address = self._remote.address  # the dispatcher it chose

    # torch's attributes, read from the plan that torch's own classes make
    @property
    def batch_size(self) -> int | None:
        return self._remote._batch_size if self._remote._plan is None else self._remote._plan.batch_size

    @property
    def drop_last(self) -> bool:
        return self._remote._drop_last

    @property
    def sampler(self) -> Any:
        return None if self._remote._plan is None else self._remote._plan.sampler

    @property
    def batch_sampler(self) -> Any:
        return None if self._remote._plan is None else self._remote._plan.batch_sampler

    @property
    def generator(self) -> Any:
        return self._remote._generator

    def __len__(self) -> int:
        return len(self._remote)

    def set_epoch(self, epoch: int) -> None:
        self._remote.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        timeout = self.timeout
        try:
            yield from self._remote
        except DpexTimeoutError as e:
            raise RuntimeError(f"DataLoader timed out after {timeout} seconds") from e

    def state_dict(self) -> dict[str, Any]:
        """See :meth:`RemoteDataLoader.state_dict` (torchdata's StatefulDataLoader usage)."""
        return self._remote.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """See :meth:`RemoteDataLoader.load_state_dict` (under DDP: every rank's state dicts, as a list)."""
        self._remote.load_state_dict(state_dict)

    def stats(self, reset: bool = False) -> LoaderStats:
        """See :meth:`RemoteDataLoader.stats`."""
        return self._remote.stats(reset)

    def close(self) -> None:
        """Stops streams and, with an embedded cluster, its processes."""
        self._remote.close()

    def __enter__(self) -> "DpexDataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
