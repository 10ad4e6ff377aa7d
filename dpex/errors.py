"""The one Dpex error hierarchy. Mapping to and from gRPC status codes lives
in dpex/rpc.py, so that this module (and dpex.wire) stays free of grpc."""
from __future__ import annotations


JOB_COLLECTED = "was collected"  # in the dispatcher's NOT_FOUND for a garbage-collected job


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


class DpexAuthError(DpexError, PermissionError):
    """A peer refused us: no or a wrong auth token, or unauthenticated shipped code."""


class DpexTimeoutError(DpexError, TimeoutError):
    """No progress within the configured timeout."""


class DpexCancelledError(DpexError):
    """An operation was cancelled because its owner is closing."""


class DpexWireError(DpexError, ValueError):
    """A value cannot be encoded, or a payload is corrupt."""


class DpexWorkerError(DpexError):
    """User code (dataset, collate) raised on a worker.

    Carries the remote exception's type name and message, the remote
    traceback, the worker's address, the sample index (-1 when the error was
    not tied to one sample) and the stage: "build" (constructing the
    dataset), "worker_init_fn", "getitem", "iterate" (an IterableDataset),
    "collate", "encode", or "process" (the worker process died).
    """

    _WHERE = {"build": "while building the dataset", "collate": "in collate_fn",
              "worker_init_fn": "in worker_init_fn", "iterate": "while iterating the dataset",
              "encode": "while encoding the batch (an unsupported type?)",
              "process": "in a worker process that died",
              "plan": "while computing the batch's indices from the epoch's sampler"}

    def __init__(self, exc_type: str, message: str, traceback: str, worker: str,
                 sample_index: int, stage: str = "getitem", batch: str = "") -> None:
        self.exc_type = exc_type
        self.remote_message = message
        self.remote_traceback = traceback
        self.worker = worker
        self.sample_index = sample_index
        self.stage = stage
        self.batch = batch
        where = (f"in dataset[{sample_index}]" if stage == "getitem"
                 else self._WHERE.get(stage, f"in {stage}"))
        text = (f"{exc_type}: {message} (raised {where} on worker {worker}"
                f"{', batch ' + batch if batch else ''})")
        if traceback:
            text += f"\nRemote traceback:\n{traceback.rstrip()}"
        super().__init__(text)

    @classmethod
    def from_remote(cls, error, batch: str = "") -> "DpexWorkerError":
        """From a dpex.v1.RemoteError message."""
        return cls(error.type, error.message, error.traceback, error.worker,
                   error.sample_index, error.stage or "getitem", batch)

    def __reduce__(self):  # keep the attributes through pickling
        return (type(self), (self.exc_type, self.remote_message, self.remote_traceback,
                             self.worker, self.sample_index, self.stage, self.batch))
