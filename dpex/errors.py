"""The one Dpex error hierarchy. Mapping to and from gRPC status codes lives
in dpex/rpc.py, so that this module (and dpex.wire) stays free of grpc."""
from __future__ import annotations


JOB_COLLECTED = "was collected"  # in the dispatcher's NOT_FOUND for a garbage-collected job
CONSUMER_IN_USE = "is in use by another loader"  # in the dispatcher's ALREADY_EXISTS for a held consumer
# A dispatcher's UNAVAILABLE while it stops (SIGTERM): its clients ride it out as an outage.
GOING_AWAY = "the dispatcher is shutting down (it may be restarting)"


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


class DpexWorkerError(DpexError, RuntimeError):
    """User code (dataset, collate) raised on a worker.

    Carries the remote exception's type name and message, the remote
    traceback, the worker's address, the batch process (torch's "worker
    process N"), the sample index (-1 when the error was not tied to one
    sample) and the stage: "build" (constructing the dataset),
    "worker_init_fn", "getitem", "iterate" (an IterableDataset), "collate",
    "encode", "plan" or "process" (the worker process died). A RuntimeError,
    as torch's DataLoader raises where it cannot rebuild the worker's
    exception; where it can, the trainer raises that type instead (see
    :func:`rebuild`), which is a DpexWorkerError as well.
    """

    _WHERE = {"build": "while building the dataset", "collate": "in collate_fn",
              "worker_init_fn": "in worker_init_fn", "iterate": "while iterating the dataset",
              "encode": "while encoding the batch (an unsupported type?)",
              "process": "in a worker process that died",
              "plan": "while computing the batch's indices from the epoch's sampler"}

    def __init__(self, message: str = "", *, exc_type: str = "", remote_message: str = "",
                 remote_traceback: str = "", worker: str = "", sample_index: int = -1, stage: str = "",
                 batch: str = "", process: int = -1) -> None:
        _set_facts(self, exc_type, remote_message, remote_traceback, worker, sample_index, stage, batch, process)
        super().__init__(message)

    def __reduce__(self):  # keep the attributes through pickling
        return (_restore, (type(self), self.args, self.__dict__))


def _restore(cls: type, args: tuple, state: dict) -> BaseException:
    e = cls.__new__(cls, *args)
    e.args = args
    e.__dict__.update(state)
    return e


def _set_facts(e: BaseException, exc_type: str, remote_message: str, remote_traceback: str, worker: str,
               sample_index: int, stage: str, batch: str, process: int) -> None:
    e.exc_type, e.remote_message, e.remote_traceback = exc_type, remote_message, remote_traceback
    e.worker, e.sample_index, e.stage, e.batch, e.process = worker, sample_index, stage, batch, process


def _facts_of(error, batch: str) -> dict:
    return dict(exc_type=error.type, remote_message=error.message, remote_traceback=error.traceback,
                worker=error.worker, sample_index=error.sample_index, stage=error.stage or "getitem",
                batch=batch, process=error.process if error.HasField("process") else -1)


def _text(exc_type: str, remote_message: str, remote_traceback: str, worker: str, sample_index: int,
          stage: str, batch: str, process: int) -> str:
    """Dpex's facts on the first line; then torch's own words ("Caught X in
    DataLoader worker process N. Original Traceback ..."), so that what
    matches torch's message matches this one."""
    where = (f"in dataset[{sample_index}]" if stage == "getitem" and sample_index >= 0
             else "in the dataset's __getitem__/__getitems__" if stage == "getitem"
             else DpexWorkerError._WHERE.get(stage, f"in {stage}"))
    text = f"{exc_type}: {remote_message} (raised {where} on worker {worker}{', batch ' + batch if batch else ''})"
    name = exc_type.rpartition(".")[2]
    if process >= 0:
        text += f"\nCaught {name} in DataLoader worker process {process} of Dpex worker {worker}."
    if remote_traceback:
        text += "\nOriginal " + remote_traceback.rstrip()
    return text


_REBUILT: dict[type, type] = {}


def _resolve(ref: str) -> type | None:
    """The exception class ``module:qualname`` names, if the trainer has that
    module imported already (nothing is imported on a worker's word)."""
    import sys
    module, _, qualname = ref.partition(":")
    obj: object = sys.modules.get(module)
    for part in qualname.split(".") if obj is not None and qualname else ["<none>"]:
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, Exception) else None


def _rebuilt_class(exc_type: type) -> type:
    """``exc_type`` that is also a DpexWorkerError: ``except KeyError`` and
    ``except DpexWorkerError`` both catch it; it prints as ``exc_type``."""
    cls = _REBUILT.get(exc_type)
    if cls is None:
        # RuntimeError and its bases are DpexWorkerError's own: a subclass of it alone, named so
        bases = (DpexWorkerError,) if issubclass(DpexWorkerError, exc_type) else (exc_type, DpexWorkerError)
        cls = type(exc_type.__name__, bases, {
            "__module__": exc_type.__module__, "__qualname__": exc_type.__qualname__,
            "__str__": lambda self: BaseException.__str__(self),  # KeyError's would repr() the text
            "__init__": lambda self, *args: exc_type.__init__(self, *args),
            "__reduce__": lambda self: (_rebuild_raw, (exc_type, self.args, self.__dict__))})
        _REBUILT[exc_type] = cls
    return cls


def _rebuild_raw(exc_type: type, args: tuple, state: dict) -> BaseException:
    return _restore(_rebuilt_class(exc_type), args, state)


def remote(kind: type, message: str, *, stage: str, worker: str, sample_index: int = -1, traceback: str = "",
           process: int | None = None):
    """An exception of type ``kind`` as a dpex.v1.RemoteError, the one error
    frame of a batch: what the trainer needs to raise it again (rebuild, its
    inverse) and to say where it happened."""
    from dpex.proto import worker_pb2 as wpb
    error = wpb.RemoteError(type=f"{kind.__module__}.{kind.__qualname__}".removeprefix("builtins."),
                            type_ref=f"{kind.__module__}:{kind.__qualname__}", message=message,
                            traceback=traceback, sample_index=sample_index, worker=worker, stage=stage)
    if process is not None:
        error.process = process
    return error


# What went wrong in a batch, for the worker's dpex_worker_errors_total{kind}.
BATCH_ERROR_KINDS = ("user_code", "process_death", "plan", "wire")


def kind_of(error) -> str:
    """A batch's error (a dpex.v1.RemoteError) as one of BATCH_ERROR_KINDS: its
    process died, its split's indices could not be computed, its value could
    not be encoded, or the user's code (dataset, collate, worker_init_fn) raised."""
    if error.stage == "process":
        return "process_death"
    if error.stage == "plan":
        return "plan"
    if error.stage == "encode" or error.type_ref == f"{__name__}:DpexWireError":
        return "wire"
    return "user_code"


def rebuild(error, batch: str = "") -> DpexWorkerError:
    """The worker's exception as the trainer raises it: of its own type where
    that type is known here and takes a message (as torch's ExceptionWrapper
    does), carrying Dpex's facts in its message and attributes; otherwise a
    DpexWorkerError. ``error`` is a dpex.v1.RemoteError."""
    facts = _facts_of(error, batch)
    text = _text(**facts)
    exc_type = _resolve(error.type_ref)
    if exc_type is None or issubclass(exc_type, DpexWorkerError):
        return DpexWorkerError(text, **facts)
    cls = _rebuilt_class(exc_type)
    try:
        e = cls(text)
    except Exception:  # noqa: BLE001 - its constructor wants more than a message: as torch, a RuntimeError
        return DpexWorkerError(text, **facts)
    _set_facts(e, **facts)
    return e


_PACKAGE = __file__.rsplit("/", 1)[0] + "/"


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """warnings.warn, attributed to the user's line: the first frame outside Dpex's package (a warning
    raised inside DpexDataLoader(...) points at the script that called it, as torch's do)."""
    import sys
    import warnings
    frame, level = sys._getframe(1), 2  # 2: the caller of warn()
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
