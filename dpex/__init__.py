"""Dpex: distributed data preprocessing for PyTorch. The public API."""
from dpex.client.loader import RemoteDataLoader
from dpex.cluster import LocalCluster
from dpex.dataset import DatasetSpec
from dpex.errors import (DpexCancelledError, DpexConfigError, DpexConflictError, DpexConnectionError,
                         DpexError, DpexNotFoundError, DpexTimeoutError, DpexWireError, DpexWorkerError)

__all__ = [
    "DatasetSpec", "DpexCancelledError", "DpexConfigError", "DpexConflictError", "DpexConnectionError",
    "DpexError", "DpexNotFoundError", "DpexTimeoutError", "DpexWireError", "DpexWorkerError",
    "LocalCluster", "RemoteDataLoader",
]
