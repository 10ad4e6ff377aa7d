"""dpex.torch_private against the installed torch: each private part of
torch's DataLoader that Dpex reaches into still does what torch's own
workers do with it, or this fails (not a user's job). torch is the oracle:
what a real DataLoader worker sees is compared with what the helpers make."""
import numpy as np
import pytest
import torch
import torch.utils.data as tud

from dpex import torch_private


class _Seen(tud.Dataset):
    """Reports, from inside torch's worker, its WorkerInfo and numpy's first draw."""

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        info = tud.get_worker_info()
        return info.id, info.num_workers, info.seed, float(np.random.rand())


def test_worker_info_and_numpys_seed_are_those_torchs_workers_get():
    loader = tud.DataLoader(_Seen(), batch_size=None, num_workers=2, generator=torch.Generator().manual_seed(5))
    seen = sorted(tuple(x) for x in loader)
    base_seed = seen[0][2] - seen[0][0]  # torch seeds worker k with base_seed + k
    for worker_id, num_workers, seed, draw in seen:
        np.random.seed(torch_private.numpy_worker_seed(base_seed, worker_id))
        assert float(np.random.rand()) == draw and seed == base_seed + worker_id and num_workers == 2
    info = torch_private.worker_info(id=1, num_workers=3, seed=7, dataset=None)
    torch_private.set_worker_info(info)
    try:
        assert tud.get_worker_info() is info and info.id == 1 and info.num_workers == 3
    finally:
        torch_private.set_worker_info(None)
    assert tud.get_worker_info() is None


def test_the_collate_machinery_makes_default_collates_batches():
    collate, tensor_fn, type_map = torch_private.collate_machinery()
    batch = [{"x": torch.ones(2), "y": 1}, {"x": torch.zeros(2), "y": 2}]
    ours, theirs = collate(batch, collate_fn_map=type_map), tud.default_collate(batch)
    assert torch.equal(ours["x"], theirs["x"]) and torch.equal(ours["y"], theirs["y"])
    assert type_map[torch.Tensor] is tensor_fn


def test_pin_memory_and_the_iterable_length_asked():
    # No accelerator here: what holds no tensor comes back as it was (a tensor would be pinned on a GPU box).
    assert torch_private.pin_memory({"a": ["text", 3]}) == {"a": ["text", 3]}

    class Stream(tud.IterableDataset):
        def __iter__(self):
            return iter(range(5))

        def __len__(self):
            return 5
    loader = tud.DataLoader(Stream(), batch_size=2)
    assert torch_private.iterable_len_asked(loader) is None
    assert len(loader) == 3 and torch_private.iterable_len_asked(loader) == 5  # the dataset's len()


def test_a_loaders_workers_stop_when_asked_as_when_collected():
    import multiprocessing
    loader = tud.DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True,
                            multiprocessing_context="fork")
    held = iter(loader)
    assert next(held).tolist() == [0, 1]
    assert multiprocessing.active_children()
    torch_private.shutdown_workers(loader, [held])
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


def test_a_loader_waits_for_its_workers_exit_as_long_as_it_is_told():
    """An IterableDataset whose worker raised: dropping its iterator waits for each worker in turn, as
    long as torch's MP_STATUS_CHECK_INTERVAL (5 s a worker in torch 2.13), shortened for the tester."""
    import gc
    import time

    class Raising(tud.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    def fail(batch):
        raise TypeError("not a batch")
    old = torch_private.set_worker_exit_wait(0.2)
    try:
        loader = tud.DataLoader(Raising(), batch_size=None, num_workers=2, collate_fn=fail,
                                multiprocessing_context="fork")
        with pytest.raises(TypeError):
            next(iter(loader))
        start = time.monotonic()
        gc.collect()  # the iterator, held by the exception's frames, goes
        assert time.monotonic() - start < 3
    finally:
        assert torch_private.set_worker_exit_wait(old) == 0.2
