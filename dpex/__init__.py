"""Dpex: distributed data preprocessing for PyTorch. The public API.

Names are imported on first use, so that the command-line tools (which
import this package) start without loading torch.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# Before gRPC is first imported (unless the user set them): a trainer that forks (torch's own
# DataLoader beside Dpex) runs no gRPC fork handlers, which are skipped and say so on every fork
# while Dpex's channels are busy, and whose child-side half could abort the forked child (Dpex
# forks its own processes before any gRPC thread runs, or from a forkserver); and gRPC's core
# logs only errors (it printed a GOAWAY line at a clean exit).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

_EXPORTS = {
    "RemoteDataLoader": "dpex.client.loader",
    "DpexDataLoader": "dpex.client.compat",
    "LoaderStats": "dpex.client.stats",
    "LocalCluster": "dpex.launch.local",
    "DatasetSpec": "dpex.dataset",
    "ShuffleSampler": "dpex.plan.shuffle",
    "BucketBatchSampler": "dpex.plan.buckets",
    "BucketedIterable": "dpex.plan.buckets",
    "sample_seed": "dpex.seeding",
    "sample_generator": "dpex.seeding",
    **{name: "dpex.errors" for name in (
        "DpexError", "DpexAuthError", "DpexCancelledError", "DpexConfigError", "DpexConflictError", "DpexConnectionError",
        "DpexNotFoundError", "DpexTimeoutError", "DpexWireError", "DpexWorkerError")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from dpex.version import package
        return package()
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dpex' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from dpex.client.compat import DpexDataLoader
    from dpex.client.loader import RemoteDataLoader
    from dpex.client.stats import LoaderStats
    from dpex.launch.local import LocalCluster
    from dpex.dataset import DatasetSpec
    from dpex.plan.shuffle import ShuffleSampler
    from dpex.plan.buckets import BucketBatchSampler, BucketedIterable
    from dpex.seeding import sample_generator, sample_seed
    from dpex.errors import (DpexAuthError, DpexCancelledError, DpexConfigError, DpexConflictError,
                             DpexConnectionError, DpexError, DpexNotFoundError, DpexTimeoutError,
                             DpexWireError, DpexWorkerError)
