"""The private parts of torch's DataLoader that Dpex relies on, each behind
one helper here and nowhere else (as dpex.stdlib for Python's):
tests/unit/test_torch_private.py checks each against the installed torch,
so that a torch release that changes one fails a test, not a user's job.
torch is imported when a helper is first called: the daemons start without it."""
from __future__ import annotations

from typing import Any


def set_worker_info(info: Any) -> None:
    """What ``get_worker_info()`` returns in this process from now on
    (``torch.utils.data._utils.worker._worker_info``, set by torch's worker loop)."""
    from torch.utils.data._utils import worker
    worker._worker_info = info


def worker_info(**fields: Any) -> Any:
    """A ``WorkerInfo`` as torch's worker loop makes one (id, num_workers, seed, dataset)."""
    from torch.utils.data._utils import worker
    return worker.WorkerInfo(**fields)


def numpy_worker_seed(base_seed: int, worker_id: int) -> Any:
    """What torch seeds numpy with in worker ``worker_id`` (``_generate_state``: its seed sequence)."""
    from torch.utils.data._utils import worker
    return worker._generate_state(base_seed, worker_id)


def collate_machinery() -> tuple[Any, Any, dict]:
    """``default_collate``'s parts: the recursive ``collate``, the tensor case
    and the type map (``torch.utils.data._utils.collate``, documented for custom collates)."""
    from torch.utils.data._utils import collate
    return collate.collate, collate.collate_tensor_fn, collate.default_collate_fn_map


def pin_memory(data: Any, device: str | None = None) -> Any:
    """A batch pinned as torch's pin-memory thread pins it (``_utils.pin_memory.pin_memory``)."""
    from torch.utils.data._utils.pin_memory import pin_memory as pin
    return pin(data, device)


def iterable_len_asked(loader: Any) -> int | None:
    """The dataset's ``len()`` as ``len(loader)`` of a DataLoader of an IterableDataset
    read it, if it was asked (``_IterableDataset_len_called``: torch warns when more come)."""
    return loader._IterableDataset_len_called


def shutdown_workers(loader: Any, iterators: Any = ()) -> None:
    """Stops the worker processes of a torch DataLoader's iterators now, as their
    collection would (``_shutdown_workers``), a persistent loader's own
    (``_iterator``) too: a harness that keeps programs' loaders around (the
    differential tester) would otherwise keep every one's workers alive."""
    for iterator in (*iterators, getattr(loader, "_iterator", None)):
        stop = getattr(iterator, "_shutdown_workers", None)
        if stop is not None:
            stop()


def set_worker_exit_wait(seconds: float) -> float:
    """How long this process's DataLoaders wait for each worker to exit
    before killing it (``_utils.MP_STATUS_CHECK_INTERVAL``, 5 s; also how
    often a waiting loader checks that its workers live); the old value.
    Workers that raised in an IterableDataset wait the whole time (torch
    2.13): a harness that drops many such iterators (the differential
    tester) pays 5 s per worker each time."""
    from torch.utils.data import _utils
    old, _utils.MP_STATUS_CHECK_INTERVAL = _utils.MP_STATUS_CHECK_INTERVAL, seconds
    return old
