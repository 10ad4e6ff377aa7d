"""A loader's job at the dispatcher: its definition (settings and the code
pickled for the workers), its name when DDP ranks share it, and the calls
that make it, submit an epoch's plan and release a consumer of it.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py."""
from __future__ import annotations

import hashlib
import logging
import secrets
import time
from typing import Any, Callable

from dpex.client.distributed import Run, shared_job_name
from dpex.client.options import LoaderOptions
from dpex.config import CLAIM_HELD_S
from dpex import dataset
from dpex.dataset import DatasetSpec
from dpex.errors import CONSUMER_IN_USE, DpexConfigError, DpexConflictError, DpexNotFoundError, warn
from dpex.plan.spec import chunks
from dpex.proto import dispatcher_pb2 as dpb
from dpex.rpc import call
from dpex.wire import callables

log = logging.getLogger("dpex.client")

LARGE_DATASET_BYTES = 4 << 20  # a dataset instance pickled larger than this is worth a DatasetSpec

Call = Callable[[Any, Any], Any]  # (stub method, request) -> response, with the loader's deadlines

_IN_FLIGHT: set = set()  # calls not waited for; a dropped gRPC future would cancel its call

Constant = dataset.Constant  # where pickles made before it moved to dpex.dataset find it


def shipped(obj: Any, what: str) -> bytes:
    """``obj`` pickled for the workers, or an error that says why it cannot travel."""
    try:
        return callables.dumps(obj)
    except Exception as e:
        raise DpexConfigError(
            f"{what} cannot be shipped to the Dpex workers, which may run on other hosts and get it as a "
            f"pickle: {type(e).__name__}: {e} (shared-memory objects such as an mp.Value, Lock or Semaphore "
            "cannot cross hosts: make them on the workers, e.g. in worker_init_fn)") from e


def code_fields(spec: DatasetSpec, collate_fn: Callable | None, worker_init_fn: Callable | None,
                bundled: bool) -> dict[str, Any]:
    """The JobDef fields of the job's code. A dataset instance goes with its
    functions in one pickle (JobDef.bundled): a bound method of the dataset
    then runs on the worker's very copy, as in torch's workers."""
    if not bundled:
        return dict(dataset=shipped(spec, "the dataset spec"),
                    collate=shipped(collate_fn, "collate_fn") if collate_fn is not None else b"",
                    worker_init_fn=shipped(worker_init_fn, "worker_init_fn") if worker_init_fn is not None else b"")
    digest = lambda fn, what: hashlib.sha256(shipped(fn, what)).digest() if fn is not None else b""  # noqa: E731
    return dict(dataset=shipped((spec, collate_fn, worker_init_fn), "the dataset"),
                collate=digest(collate_fn, "collate_fn"), worker_init_fn=digest(worker_init_fn, "worker_init_fn"),
                bundled=True)


def content(code: tuple[DatasetSpec, Callable | None, Callable | None]) -> bytes:
    """What the job's code is, the same in every process (JobDef.content): a rerun under the job's
    name, or a sweep's trial, is the same definition though its pickle differs."""
    return callables.digest(code)


def definition(job: dpb.JobDef) -> bytes:
    """The job's settings without its pickled code: the same bytes in every rank."""
    bare = dpb.JobDef()
    bare.CopyFrom(job)
    for name in ("dataset", "collate", "worker_init_fn", "content"):
        bare.ClearField(name)
    return bare.SerializeToString(deterministic=True)


def job_def(opts: LoaderOptions, code: tuple[DatasetSpec, Callable | None, Callable | None], bundled: bool,
            unbatched: bool) -> dpb.JobDef:
    """The job a loader of ``opts`` asks for; ``code`` is (spec, collate_fn, worker_init_fn)."""
    job = dpb.JobDef(name=opts.job_name or "", num_consumers=opts.num_consumers,
                     persistent_workers=opts.persistent_workers, **code_fields(*code, bundled=bundled),
                     content=content(code),
                     batch_size=opts.batch_size or 0, drop_last=opts.drop_last, compression=opts.compression,
                     unbatched=unbatched, process_seeds=not opts.reproducible, main_process=opts.num_workers == 0,
                     out_of_order=not opts.ordered, no_share=not opts.share, sample_cache=opts.cache or "")
    if bundled and len(job.dataset) > LARGE_DATASET_BYTES:
        warn(f"the dataset instance pickles to {len(job.dataset) / 2**20:.1f} MB and goes to every worker by "
             "value; if it reads files, dpex.DatasetSpec('package.module:Class', ...) builds it on the workers "
             "from their own local copy instead")
    return job


def name_shared(job: dpb.JobDef, run: Run | None) -> bool:
    """Names an unnamed job of several consumers after the DDP run its ranks
    share (True), or warns that outside one it stays a job of its own."""
    if job.name or job.num_consumers <= 1:
        return False
    if run is None:
        warn(f"num_consumers={job.num_consumers} without job_name and outside torch.distributed: this "
             "loader makes a job of its own; give every consumer the same job_name to share one")
        return False
    job.name = shared_job_name(run, definition(job))
    log.info("rank %d of %d: job %r, shared by the ranks of this run", run.rank, run.world_size, job.name)
    return True


def make(call_: Call, stub: Any, request: dpb.GetOrCreateJobRequest, named: bool) -> tuple[int, bytes]:
    """The job's id and key (dpex.keys): the loader's own job (``named``), or
    an unnamed job of the same definition, for another lane (dpex.client.lanes)."""
    if not named and request.job.name:
        request, named_request = dpb.GetOrCreateJobRequest(), request
        request.CopyFrom(named_request)
        request.job.name, request.settings_only = "", False
    response = call_(stub.GetOrCreateJob, request)
    return response.job_id, response.job_key


def submit(call_: Call, stub: Any, request: dpb.SubmitPlanRequest, batches: list[dpb.IndexBatch]) -> int:
    """Submits an epoch's plan (the number of batches planned), waiting up to
    the claim time (CLAIM_HELD_S) for a consumer held by a loader gone
    silent (a trainer killed and run again at once: the dispatcher may not
    have seen its connection end); a live holder keeps it, and this loader
    gets its DpexConflictError."""
    deadline = time.monotonic() + CLAIM_HELD_S + 1.0
    while True:
        try:
            return _submit_once(call_, stub, request, batches)
        except DpexConflictError as e:
            if CONSUMER_IN_USE not in str(e) or time.monotonic() > deadline:
                raise
            log.info("%s; waiting up to %.0fs for its holder to go silent", e, deadline - time.monotonic())
            time.sleep(0.25)


def _submit_once(call_: Call, stub: Any, submit_: dpb.SubmitPlanRequest, batches: list[dpb.IndexBatch]) -> int:
    """A description or streams in one call, explicit batches in bounded chunks."""
    if submit_.num_streams or submit_.HasField("sampler"):
        return call_(stub.SubmitPlan, submit_).num_batches
    parts = list(chunks(batches))
    for attempt in range(3):
        submit_.upload_id = secrets.randbits(63) + 1
        try:
            for i, part in enumerate(parts):
                request = dpb.SubmitPlanRequest()
                request.CopyFrom(submit_)
                request.chunk, request.more = i, i + 1 < len(parts)
                request.batches.extend(part)
                response = call_(stub.SubmitPlan, request)
            return response.num_batches
        except DpexNotFoundError as e:  # the dispatcher restarted mid-upload: from the start
            if attempt == 2 or "plan upload" not in str(e):
                raise
            log.warning("%s", e)
    raise AssertionError("unreachable")


def send_and_forget(method: Any, request: Any, timeout_s: float = 5.0) -> None:
    """Starts a unary call and returns at once (from a finalizer: never block)."""
    future = method.future(request, timeout=timeout_s)
    _IN_FLIGHT.add(future)
    future.add_done_callback(_IN_FLIGHT.discard)


def releaser(stub: Any, target: str, request: dpb.ReleaseConsumerRequest) -> Callable[[bool], None]:
    """Releases a consumer: waiting for the answer (``wait``) or not (from a
    finalizer). It holds no loader: it may run at the loader's collection."""
    return lambda wait=True: (call(stub.ReleaseConsumer, request, target=target, timeout_s=5) if wait
                              else send_and_forget(stub.ReleaseConsumer, request))
