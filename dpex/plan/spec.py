"""What identifies a plan (its hash), and explicit plans cut into bounded chunks."""
from __future__ import annotations

import hashlib
from typing import Iterable, Iterator

from dpex.proto import dispatcher_pb2 as dpb

CHUNK_INDICES = 1 << 18  # indices per SubmitPlan message of an explicit plan (2 MB on the wire)


class PlanHash:
    """sha256 of a plan: the same epoch submitted again (a reconnect) hashes the same."""

    def __init__(self, base_seed: int, num_streams: int, sampler: dpb.SamplerSpec | None = None) -> None:
        self._h = hashlib.sha256(base_seed.to_bytes(8, "little") + num_streams.to_bytes(4, "little"))
        if sampler is not None:
            self._h.update(b"sampler" + sampler.SerializeToString(deterministic=True))

    def update(self, batches: Iterable[dpb.IndexBatch]) -> None:
        for batch in batches:
            self._h.update(batch.SerializeToString())
            self._h.update(b"|")

    def digest(self) -> bytes:
        return self._h.digest()


def resumed(digest: bytes, done: Iterable[dpb.SeqRange], resume_id: int) -> bytes:
    """A resumed epoch's hash: a plan of its own (see SubmitPlanRequest.done)."""
    done = list(done)
    if not done and not resume_id:
        return digest
    h = hashlib.sha256(digest + b"resume%d" % resume_id)
    for r in done:
        h.update(b"|%d-%d" % (r.start, r.end))
    return h.digest()


def of_loader(digest: bytes, client_id: int, attempt: int = 0) -> bytes:
    """A plan's hash as the plan of one loader (its client id) in one iter()
    (its attempt): that iter()'s plan submitted again is a reconnect; the same
    loader's epoch begun again, or another loader's equal plan (the same script
    rerun after a crash), is a plan of its own, which replaces it."""
    if client_id:
        digest = hashlib.sha256(digest + b"client%d" % client_id).digest()
    return digest if not attempt else hashlib.sha256(digest + b"attempt%d" % attempt).digest()


def chunks(batches: list[dpb.IndexBatch], max_indices: int = CHUNK_INDICES) -> Iterator[list[dpb.IndexBatch]]:
    """Consecutive runs of whole batches, each of at most ``max_indices``
    indices (or one batch, if a single batch is larger); at least one run."""
    start, count = 0, 0
    for i, batch in enumerate(batches):
        if count and count + len(batch.indices) > max_indices:
            yield batches[start:i]
            start, count = i, 0
        count += len(batch.indices)
    yield batches[start:]


# JobDef fields that do not change what a batch holds: who asks, and how batches pass busy processes.
_NOT_CONTENT = ("name", "num_consumers", "out_of_order", "sample_cache")
_PICKLED = ("dataset", "collate", "worker_init_fn")  # per process: JobDef.content says what they are
CODE = {"dataset", "collate", "worker_init_fn", "content"}  # the code, pickled, and what it is
# JobDef fields by the loader argument that sets them.
_ARGUMENT = {"collate": "collate_fn", "process_seeds": "reproducible", "main_process": "num_workers",
             "out_of_order": "in_order", "no_share": "share"}


def differing_fields(a: dpb.JobDef, b: dpb.JobDef, settings_only: bool = False) -> list[str]:
    """The loader arguments on which two definitions of a job differ (with
    ``settings_only``, not counting the pickled code)."""
    # Code of equal content (JobDef.content) is the same, though its pickle differs per process.
    same_code = settings_only or (a.content and a.content == b.content)
    return [_ARGUMENT.get(f.name, f.name) for f in dpb.JobDef.DESCRIPTOR.fields
            if f.name not in ("name", "content") and not (same_code and f.name in CODE)
            and getattr(a, f.name) != getattr(b, f.name)]


def content_differences(a: dpb.JobDef, b: dpb.JobDef) -> list[str]:
    """The loader arguments on which two definitions differ in what their batches hold."""
    ignored = {_ARGUMENT.get(name, name) for name in _NOT_CONTENT}
    return [name for name in differing_fields(a, b) if name not in ignored]


def share_digest(job: dpb.JobDef) -> bytes | None:
    """The digest jobs of one definition share, whose batches are then the
    same for the same epoch, base seed and samples (their draws are keyed by
    place, dpex.seeding): what the dataset, collate_fn and worker_init_fn
    are (JobDef.content; from older clients, their pickles), and every setting but the name, the number of consumers and
    in_order. None: the job shares nothing (``share=False``, or draws that
    follow the process that makes a batch, ``reproducible=False``)."""
    if job.no_share or job.process_seeds:
        return None
    content = dpb.JobDef()
    content.CopyFrom(job)
    for name in _NOT_CONTENT + (_PICKLED if job.content else ()):  # what the code is, not its pickle
        content.ClearField(name)
    return hashlib.sha256(b"dpex-share-1" + content.SerializeToString(deterministic=True)).digest()[:16]


def plan_share_key(digest: bytes | None, content: bytes, epoch: int) -> bytes:
    """Equal for the plans of jobs of one definition (``digest``: their
    share_digest) whose splits hold equal batches (``content``: the plan's own
    hash, before resume and client), so that the dispatcher gives their equal
    splits to one worker; b"": none."""
    return b"" if digest is None else hashlib.sha256(digest + content + b"epoch%d" % epoch).digest()[:16]
