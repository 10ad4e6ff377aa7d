"""The one Dpex error hierarchy. Mapping to and from gRPC status codes lives
in dpex/rpc.py, so that this module (and dpex.wire) stays free of grpc."""
from __future__ import annotations


class DpexError(Exception):
    """Base class of every error Dpex raises on purpose."""


class DpexConfigError(DpexError, ValueError):
    """A bad argument or configuration value."""


class DpexConnectionError(DpexError, ConnectionError):
    """A dispatcher or worker could not be reached."""


class DpexNotFoundError(DpexError, LookupError):
    """An unknown job, worker or dataset target."""


class DpexConflictError(DpexError):
    """A job exists under this name with different parameters."""


class DpexTimeoutError(DpexError, TimeoutError):
    """No progress within the configured timeout."""


class DpexCancelledError(DpexError):
    """An operation was cancelled because its owner is closing."""


class DpexWireError(DpexError, ValueError):
    """A value cannot be encoded, or a payload is corrupt."""


class DpexWorkerError(DpexError):
    """User code (dataset, collate) raised on a worker.

    Carries the remote exception's type name and message, the remote
    traceback, the worker's address and the sample index (-1 when the error
    was not tied to one sample, e.g. in collate).
    """

    def __init__(self, exc_type: str, message: str, traceback: str,
                 worker: str, sample_index: int, batch: str = "") -> None:
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback
        self.worker = worker
        self.sample_index = sample_index
        self.batch = batch
        where = f"dataset[{sample_index}]" if sample_index >= 0 else "collate"
        text = (f"{exc_type}: {message} (raised in {where} on worker {worker}"
                f"{', batch ' + batch if batch else ''})\n"
                f"Remote traceback:\n{traceback.rstrip()}")
        super().__init__(text)

    def __reduce__(self):  # keep the attributes through pickling
        return (type(self), (self.exc_type, self.remote_message, self.remote_traceback,
                             self.worker, self.sample_index, self.batch))
