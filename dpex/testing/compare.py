"""Batches as comparable values, for tests that hold Dpex's output against torch's."""
from __future__ import annotations

from typing import Any

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
