"""One computation for every job of one definition.

With keyed draws a batch is a pure function of its job's definition
(dpex.plan.spec.share_digest), its epoch, its base seed and its samples with
their places: that is its content key. Three trials of a sweep that read the
same epoch ask this worker for batches of equal content keys; each is made
once. A batch being made for one job is waited for by the others (they take
no batch process meanwhile); a batch made is kept, re-headed for each job
that still wants it (its job, consumer, epoch and place in the epoch are its
own), and dropped once they all had it, or evicted, oldest first, to stay
within ``max_bytes``. A job that comes later, or falls behind what is kept,
has its batches made again: exact either way, and nobody waits for it.

A batch that failed is not kept: each job makes it itself (an error in user
code then fails each as it would alone; a process that died is not shared).
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, NamedTuple

from dpex import shm
from dpex.proto import worker_pb2 as wpb
from dpex.wire import frame_parts, parse_frame
from dpex.worker.runners import not_assigned_frame
from dpex.worker.runtime import Task

def content_key(digest: bytes, task: Task) -> bytes:
    """What a batch holds, as a key: equal for equal batches of jobs of one definition."""
    h = hashlib.sha256(digest)
    h.update(b"%d|%d|%d|" % (task.key.epoch, task.base_seed, task.whole))
    h.update(",".join(map(str, task.indices)).encode() + b"|" + ",".join(map(str, task.places)).encode())
    return h.digest()[:16]


class _Kept(NamedTuple):
    meta: wpb.Batch      # the maker's header (its ids are replaced for each job)
    payload: memoryview  # the batch's bytes, a view of ``frame``
    frame: bytes
    wanted: set          # jobs held here that have not had it yet


class Shared:
    """The batches this worker made for jobs that share, and those being made.

    ``make_frame(parts)``: a frame of the given parts, as the batch processes
    make them (a hand-off file when large, else bytes). Thread-safe."""

    def __init__(self, max_bytes: int, make_frame: Callable[[list], "bytes | shm.Handoff"]) -> None:
        self.max_bytes = max_bytes
        self._make_frame = make_frame
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, _Kept] = OrderedDict()  # oldest first
        self._bytes = 0
        self._making: dict[bytes, list[tuple[object, Future]]] = {}  # content key -> (key, future) following it
        self.hits = 0      # batches a job got from another job's making
        self.misses = 0    # batches of sharing jobs made here

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._bytes

    def make(self, ck: bytes, key: object, make: Callable[[], Future],
             wanted: Callable[[], set]) -> tuple[Future, bool]:
        """Batch ``key`` (a runners.Key) of content ``ck``: re-headed from a
        kept one; or waited for while another job makes it here (then True:
        it takes no batch process), made anew if that making fails; or made
        with ``make()``, for the followers that come meanwhile and kept for
        the jobs ``wanted()`` names. ``make()`` raises RuntimeError when the pool is closing."""
        frame = self.take(ck, key)
        if frame is not None:
            done: Future = Future()
            done.set_result(frame)
            return done, False
        followed = self.follow(ck, key)
        if followed is not None:
            return _or_else(followed, make, key), True
        self.lead(ck)
        jobs = wanted()
        made = make()
        made.add_done_callback(lambda f: self.made(ck, f.result(), jobs))
        return made, False

    def take(self, ck: bytes, key: object) -> "bytes | shm.Handoff | None":
        """Batch ``key`` (a runners.Key) from a kept batch of content ``ck``, if any."""
        with self._lock:
            kept = self._kept.get(ck)
            if kept is None:
                return None
            kept.wanted.discard(key.job_id)
            if not kept.wanted:
                self._drop(ck)
            self.hits += 1
        return self._reheaded(kept, key)

    def follow(self, ck: bytes, key: object) -> Future | None:
        """A future of batch ``key``, made by the job now making content
        ``ck`` here (None: none is; the caller makes it, then calls :meth:`lead`).
        Its result is None if that making failed: the caller makes it then."""
        with self._lock:
            followers = self._making.get(ck)
            if followers is None:
                return None
            future: Future = Future()
            followers.append((key, future))
            return future

    def lead(self, ck: bytes) -> None:
        """This worker makes content ``ck`` now: others of it follow."""
        with self._lock:
            self._making[ck] = []
            self.misses += 1

    def made(self, ck: bytes, frame: "bytes | shm.Handoff", wanted: set) -> None:
        """The batch of content ``ck`` is made: to its followers, and kept
        for ``wanted`` (the other jobs held here that may ask for it)."""
        with self._lock:
            followers = self._making.pop(ck, [])
        if not followers and not wanted:
            return  # nobody else will ask: the frame is not read back (a hand-off file's bytes)
        kept = self._keep(frame) if not _failed(frame) else None
        for key, future in followers:
            wanted.discard(key.job_id)
            future.set_result(self._reheaded(kept, key) if kept is not None else None)
        with self._lock:
            self.hits += len(followers) if kept is not None else 0
            if kept is None or not wanted or len(kept.frame) > self.max_bytes:
                return
            self._kept[ck] = kept._replace(wanted=set(wanted))
            self._kept.move_to_end(ck)
            self._bytes += len(kept.frame)
            while self._bytes > self.max_bytes:
                self._drop(next(iter(self._kept)))

    def forget_job(self, job_id: int) -> None:
        """A job no longer held here: it will not ask for what is kept for it."""
        with self._lock:
            for ck in [ck for ck, kept in self._kept.items() if job_id in kept.wanted]:
                self._kept[ck].wanted.discard(job_id)
                if not self._kept[ck].wanted:
                    self._drop(ck)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    def _drop(self, ck: bytes) -> None:
        kept = self._kept.pop(ck)
        self._bytes -= len(kept.frame)

    @staticmethod
    def _keep(frame: "bytes | shm.Handoff") -> _Kept | None:
        """The frame's bytes, copied out of a hand-off file (which its own job's trainer takes)."""
        if isinstance(frame, shm.Handoff):
            try:
                data = shm.read(frame)
            except OSError:
                return None
            if len(data) != frame.size:
                return None
        else:
            data = bytes(frame)
        meta, payload = parse_frame(data)
        return _Kept(meta, payload, data, set())

    def _reheaded(self, kept: _Kept, key: object) -> "bytes | shm.Handoff":
        meta = wpb.Batch()
        meta.CopyFrom(kept.meta)
        meta.job_id, meta.consumer_index, meta.epoch, meta.seq = key.job_id, key.consumer_index, key.epoch, key.seq
        meta.attempt = key.attempt
        return self._make_frame(frame_parts(meta, [kept.payload]))


def _or_else(followed: Future, make: Callable[[], Future], key: object) -> Future:
    """``followed``'s frame, or (None: the making it followed failed) a batch made anew."""
    out: Future = Future()

    def settle(f: Future) -> None:
        frame = f.result()
        if frame is not None:
            out.set_result(frame)
            return
        try:
            make().add_done_callback(lambda again: out.set_result(again.result()))
        except RuntimeError:  # the pool is closing: the trainer asks another worker, as for any batch it made
            out.set_result(not_assigned_frame(key))
    followed.add_done_callback(settle)
    return out


def _failed(frame: "bytes | shm.Handoff") -> bool:
    """An error frame (small: never a hand-off file)."""
    if isinstance(frame, shm.Handoff):
        return False
    meta, _ = parse_frame(frame)
    return meta.HasField("error") or meta.not_assigned
