"""Batches as comparable values, for tests that hold Dpex's output against torch's."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch


def plain(value: Any) -> Any:
    """A batch as plain values that keep their types: a tensor by dtype, shape and content, an array by
    dtype and content, a container by its type and items, anything else by its type and itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.tolist())
    if isinstance(value, dict):
        return ("dict", {k: plain(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [plain(v) for v in value])
    return (type(value).__name__, value)


def read_epochs(loader: Any, n_epochs: int, *, value: Callable[[int, Any], Any], stop_at: int | None = None,
                state: dict | None = None, on_batch: Callable[[int], None] | None = None) -> tuple[list, dict | None]:
    """Reads ``loader``'s epochs up to epoch ``n_epochs``, from the one ``state``
    (a state dict, loaded first) is in: each batch as ``value(epoch, batch)``,
    ``on_batch(count)`` called after each; stopped after ``stop_at`` batches with
    the loader's state dict then (else None), as a checkpointing script does."""
    got: list = []
    if state is not None:
        loader.load_state_dict(state)
    start = state["epochs_started"] - (state["epoch"] is not None) if state else 0
    for epoch in range(start, n_epochs):
        for batch in loader:
            got.append(value(epoch, batch))
            if on_batch is not None:
                on_batch(len(got))
            if len(got) == stop_at:
                return got, loader.state_dict()
    return got, None
