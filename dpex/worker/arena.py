"""A batch process's reusable memory for default_collate.

torch's default_collate, run in a worker, stacks every batch into a new
shared-memory segment for the main process to map. A Dpex batch goes into a
hand-off file or a gRPC message instead, so a batch process stacks each
batch into the same buffer: no pages to fault in and zero per batch, and no
batch-sized holes in the heap (a fresh buffer per batch made glibc serve
batches from the heap, where the small objects an epoch keeps split the hole
each batch left, and the process grew by a batch per epoch).
"""
from __future__ import annotations

from typing import Any

import torch
from dpex.torch_private import collate_machinery

collate, collate_tensor_fn, default_collate_fn_map = collate_machinery()

_ALIGN = 64


class Arena:
    """One buffer the tensors of a batch are carved from, reused by the next
    batch; it grows to the largest batch seen. A batch may be carved from a
    region given instead (a hand-off file's data section: dpex.worker.slabs)."""

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self._region = self._buffer
        self._used = 0
        self._wanted = 0  # the batch that did not fit: the size to grow to
        self.size = 0     # the bytes the last batch took (64-byte aligned tensors)

    def _reset(self, region: torch.Tensor | None) -> None:
        if region is None:
            if self._wanted > self._buffer.numel():
                self._buffer = torch.empty(self._wanted, dtype=torch.uint8)
            region = self._buffer
        self._region = region
        self._used = self._wanted = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        start = -(-self._used // _ALIGN) * _ALIGN
        self._used = start + nbytes
        if self._used > self._region.numel():
            self._wanted = max(self._wanted, self._used)
            return torch.empty(shape, dtype=dtype)  # this batch only; the next one fits
        return self._region[start:self._used].view(dtype).view(shape)

    @property
    def overflowed(self) -> bool:
        """The last batch did not fit: some of its tensors lie elsewhere."""
        return self._wanted > 0

    def collate(self, samples: list, region: torch.Tensor | None = None) -> Any:
        """torch's default_collate, with tensors stacked into this arena (or
        into ``region``, uint8): the result is valid until the next call
        (callers encode it before)."""
        self._reset(region)
        try:
            batch = collate(samples, collate_fn_map={**default_collate_fn_map, torch.Tensor: self._stack})
        finally:
            self._region = self._buffer  # a region lent (a hand-off file's) is not held past its batch
        self.size = self._used
        return batch

    def _stack(self, batch: list, *, collate_fn_map: Any = None) -> torch.Tensor:
        elem = batch[0]
        if elem.is_nested or elem.layout != torch.strided or elem.device.type != "cpu" or any(
                x.shape != elem.shape for x in batch):
            return collate_tensor_fn(batch)  # torch's own checks and messages
        out = self.empty((len(batch), *elem.shape), elem.dtype)
        return torch.stack(batch, 0, out=out)
