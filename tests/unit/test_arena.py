"""default_collate into a batch process's reusable arena."""
import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from dpex.worker.arena import Arena


def _samples(k: int) -> list:
    return [{"x": torch.full((3, 5), float(i)), "y": i, "n": np.arange(4, dtype=np.int16) + i,
             "t": (torch.tensor([i], dtype=torch.bool), "s")} for i in range(k)]


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_same_batches_as_default_collate_and_each_batch_reuses_the_memory():
    arena = Arena()
    first = arena.collate(_samples(4))  # the arena is empty: fresh tensors, and it grows for the next
    assert _equal(first, default_collate(_samples(4)))
    second = arena.collate(_samples(4))
    assert _equal(second, default_collate(_samples(4)))
    pointer = second["x"].data_ptr()
    third = arena.collate(_samples(3))  # smaller: fits in the same memory
    assert _equal(third, default_collate(_samples(3)))
    assert third["x"].data_ptr() == pointer
    assert all(t.data_ptr() % 64 == 0 for t in (third["x"], third["n"]))


def test_shapes_that_differ_get_torchs_own_error():
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
        Arena().collate([torch.zeros(2), torch.zeros(3)])
