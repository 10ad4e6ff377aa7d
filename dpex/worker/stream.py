"""IterableDataset streams: stream k of N runs in a process of its own, as
torch's worker k does (get_worker_info() says k of N), iterates the dataset,
batches, collates and encodes; batch j is seq ``j * N + k``. Stream
processes are forked from the daemon's forkserver, which has torch imported.

The process sends one frame per credit the daemon grants over a pipe, so a
stream never runs more than ``buffer_batches`` ahead of the trainer.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import threading
from typing import Any, Callable, NamedTuple

import cloudpickle

from dpex.plan.seq import stream_seq
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import worker_pb2 as wpb
from dpex.wire import build_frame, frame_parts, parse_frame
from dpex import seeding, wire
from dpex.worker import runtime
from dpex.log import fields

log = logging.getLogger("dpex.worker")

Sink = Callable[[bytes], None]


def _meta(split: Any, j: int, **fields: Any) -> wpb.Batch:
    return wpb.Batch(job_id=split["job_id"], consumer_index=split["consumer_index"], epoch=split["epoch"],
                     seq=stream_seq(split["stream"], j, split["num_streams"]), **fields)


_END = object()


class _Resumable(NamedTuple):
    """A stream's state after a batch: its dataset's ``state_dict()`` and,
    for a job with keyed draws, its process's generators."""
    dataset: Any
    rng: tuple


def run_stream(split: dict, job_path: str, worker_address: str, conn: Any) -> None:
    """The stream process: iterate, batch, send a frame per credit, then the end."""
    runtime.init_process(worker_address)
    credits = 0

    def send(frame: bytes) -> bool:
        nonlocal credits
        while credits == 0:
            try:
                got = conn.recv()
            except EOFError:
                return False
            if got is None:
                return False
            credits += got
        credits -= 1
        conn.send_bytes(frame)
        return True

    j, stage = split["next"], "build"
    try:
        job = runtime.load_job(split["job_id"], job_path)
        stage = "worker_init_fn"
        runtime.become_worker(job, split["base_seed"], split["stream"], split["num_streams"])
        if job.worker_init_fn is not None:
            job.worker_init_fn(split["stream"])
        stateful = callable(getattr(job.dataset, "state_dict", None))
        if split["state"]:  # a resumed stream: where the dataset said it was after batch next-1
            stage = "load_state_dict"
            saved = pickle.loads(split["state"])
            if isinstance(saved, _Resumable):  # and where its generators were: it draws on as it would have
                seeding.restore_global_states(saved.rng)
                saved = saved.dataset
            job.dataset.load_state_dict(saved)
        stage = "iterate"
        samples = iter(job.dataset)
        while True:
            stage = "iterate"
            if job.unbatched:  # batch_size=None: each item is a batch, through collate_fn alone
                item = next(samples, _END)
                if item is _END:
                    break
                batch = item
            else:
                batch = list(itertools.islice(samples, job.batch_size))
                if not batch or (job.drop_last and len(batch) < job.batch_size):
                    break
            stage = "state_dict"  # a stream without one is resumed by running it again from its start
            saved = job.dataset.state_dict() if stateful else None
            stage = "collate"
            collated = runtime.collate(job, batch)
            state = b""
            if stateful:  # the generators as collate_fn left them: where the next batch draws from
                state = cloudpickle.dumps(_Resumable(saved, seeding.global_states()) if job.keyed else saved)
            stage = "encode"
            frame = b"".join(frame_parts(_meta(split, j, stream_state=state), wire.encode_parts(collated)))
            if not send(frame):
                return
            j += 1
    except Exception as e:
        meta = _meta(split, j, error=runtime.remote_error(e, stage, process=split["stream"]))
        if not send(meta.SerializeToString()):
            return
        j += 1
    send(_meta(split, j, end_of_stream=True).SerializeToString())


_context: Any = None


def _stream_context(temp_dir: str) -> Any:
    """Where stream processes come from: forked from this daemon's forkserver,
    which imported torch once (a stream is a new process every epoch, as
    torch's workers are without persistent_workers; spawning each would
    import torch again, a second and more). Not forked from the daemon
    itself: it runs gRPC threads. The forkserver's socket goes in
    ``temp_dir``, the daemon's own directory, which a later worker removes
    if this one is killed (multiprocessing's own would stay behind)."""
    global _context
    if _context is None:
        multiprocessing.current_process()._config.setdefault("tempdir", temp_dir)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "dpex.worker.stream"])
        _context = context
    return _context


class StreamRunner:
    """The daemon's side of one stream: grants credits, holds what arrived,
    answers requests by seq; frames below the first request are skipped (a
    stream re-run after a failure starts again from its first batch)."""

    def __init__(self, split: dpb.Split, job_path: str, worker_address: str, buffer_batches: int) -> None:
        self._split = dict(job_id=split.job_id, consumer_index=split.consumer_index, epoch=split.epoch,
                           stream=split.first_seq, num_streams=split.num_streams, base_seed=split.base_seed,
                           next=split.stream_next, state=split.stream_state)
        self._buffer = buffer_batches
        self._cond = threading.Condition()
        self._ready: dict[int, bytes] = {}
        self._waiters: dict[int, list[Sink]] = {}
        self._end: int | None = None
        self._granted = self._received = split.stream_next  # batches before it were delivered
        self._floor: int | None = None
        self._closed = False
        context = _stream_context(os.path.dirname(job_path))
        self._conn, child = context.Pipe()
        self._process = context.Process(target=run_stream, args=(self._split, job_path, worker_address, child),
                                        name=f"dpex-stream-{split.first_seq}")
        self._process.start()
        child.close()
        self._thread = threading.Thread(target=self._receive, name="dpex-stream-recv")
        self._thread.start()

    def _end_frame(self, j: int) -> bytes:
        return build_frame(_meta(self._split, j, end_of_stream=True))

    def request(self, j: int, sink: Sink) -> None:
        with self._cond:
            if self._floor is None:
                self._floor = j
            frame = self._ready.pop(j, None)
            if frame is not None:
                sink(frame)
            elif self._end is not None and j >= self._end:
                sink(self._end_frame(j))
            else:
                self._waiters.setdefault(j, []).append(sink)
            self._grant()

    def cancel(self, sink: Sink) -> None:
        with self._cond:
            for j in list(self._waiters):
                self._waiters[j] = [s for s in self._waiters[j] if s != sink]
                if not self._waiters[j]:
                    del self._waiters[j]

    def _grant(self) -> None:
        """Credits so that arrived-but-unasked frames stay within the buffer,
        and enough to reach the furthest batch a trainer waits for."""
        if self._end is not None or self._closed:
            return
        in_flight = self._granted - self._received
        room = self._buffer - len(self._ready) - in_flight
        reach = max(self._waiters, default=-1) + 1 - self._granted
        n = max(room, reach)
        if n > 0:
            try:
                self._conn.send(n)
                self._granted += n
            except (OSError, BrokenPipeError):
                pass

    def _receive(self) -> None:
        while True:
            try:
                frame = self._conn.recv_bytes()
            except (EOFError, OSError):
                frame = None
            with self._cond:
                if frame is None or self._closed:
                    if self._end is None and not self._closed:
                        log.error("stream ended without its end marker",
                                  extra=fields(job_id=self._split["job_id"], stream=self._split["stream"]))
                    return
                j = self._received
                self._received += 1
                meta, _ = parse_frame(frame)
                if meta.end_of_stream:
                    self._end = j
                    for wj in [w for w in self._waiters if w >= j]:
                        for sink in self._waiters.pop(wj):
                            sink(self._end_frame(wj))
                    return
                if self._floor is not None and j < self._floor and j not in self._waiters:
                    self._grant()
                    continue
                sinks = self._waiters.pop(j, None)
                if sinks:
                    for sink in sinks:
                        sink(frame)
                else:
                    self._ready[j] = frame
                self._grant()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        try:
            self._conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self._process.join(5)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._conn.close()
        if self._thread is not threading.current_thread():
            self._thread.join()
