"""The splits a worker holds: one runner per split behind one interface
(:class:`SplitRunner`, as tf.data service's ``TaskRunner``), so that the
scheduler (dpex.worker.scheduler) needs no case per kind of split.

- :class:`MapRunner`: a map-style split. The worker's pool makes its
  batches, in the order the scheduler picks under the buffer's budget; the
  runner holds its index batches (once planned, dpex.worker.planner), the
  batches made but not asked for yet, and the requests waiting for one.
- :class:`StreamRunner`: an IterableDataset stream, made in a process of its
  own (dpex.worker.stream), which answers its requests itself.

:class:`Held` finds the runner of a batch by its key. Runners hold no lock:
the scheduler calls them under its own, except :meth:`SplitRunner.close`.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator, Protocol

from dpex import errors, shm
from dpex.log import fields
from dpex.plan import seq as seqs
from dpex.proto import dispatcher_pb2 as dpb
from dpex.wire import build_frame, parse_frame
from dpex.worker import stream
from dpex.wire.batchkey import EpochKey, Key
from dpex.worker.budget import Budget, Consumer
from dpex.worker.pool import BatchPool, crash_frame
from dpex.worker.runtime import Task, produce

log = logging.getLogger("dpex.worker")

Frame = "bytes | shm.Handoff"  # a Handoff: the frame lies in a /dev/shm file (dpex.shm)
Sink = Callable[[Frame], None]


# Told of each batch a stream's process made: its bytes, seconds, and its error's kind (errors.kind_of) if any.
Made = Callable[[int, float, "str | None"], None]


def split_keys(split: dpb.Split) -> list[Key]:
    """The batch ids of a (map-style) split, in order."""
    return [Key(split.epoch, s, split.consumer_index, split.job_id, split.attempt)
            for s in seqs.split_seqs(split.first_seq, split.num_batches or len(split.batches))]


def not_assigned_frame(key: Key) -> bytes:
    return build_frame(key.header(not_assigned=True))


def make(split: dpb.Split, job_path: str, worker_address: str, buffer: int, budget: Budget,
         made: Made | None = None) -> "SplitRunner":
    """The runner of a held split (as tf.data service's TaskRunner::Create): its
    stream's process (an IterableDataset epoch), which tells ``made`` of each
    batch it receives, or its batches' in the pool."""
    if split.num_streams:
        return StreamRunner(split, job_path, worker_address, buffer, made)
    return MapRunner(split, budget)


class SplitRunner(Protocol):
    """One held split, as the scheduler sees it."""
    split: dpb.Split
    consumer: Consumer
    pooled: bool   # the worker's pool makes its batches, under the scheduler's budget
    planned: bool  # its batches may be made (a described split's indices are known)

    def request(self, key: Key, sink: Sink) -> bool:
        """Answers ``sink`` with batch ``key`` now, or holds it until the
        batch is made; True: it waits for the pool to make it."""

    def cancel(self, sink: Sink) -> None:
        """Forgets a closed Fetch stream's requests."""

    def unproduced(self) -> int:
        """Batches left for the pool to make: what keeps the worker's capacity taken."""

    def release(self) -> None:
        """The split is taken back: frees what it holds; requests that wait are told it is not here."""

    def close(self) -> None:
        """Stops what runs for it; called outside the scheduler's lock (it may block)."""


class MapRunner:
    """A map-style split, made batch by batch by the worker's pool."""

    pooled = True

    def __init__(self, split: dpb.Split, budget: Budget) -> None:
        self.split = split
        self.consumer = (split.job_id, split.consumer_index)
        self.keys = split_keys(split)
        self._offset = {key: i for i, key in enumerate(self.keys)}
        self._budget = budget
        self.batches: list[list[int]] | None = None  # None: being computed from the epoch's sampler
        self.places: list[list[int]] | None = None   # each batch's samples' places (dpex.seeding); [] if not sent
        self.error: BaseException | None = None      # they could not be: each batch is this error
        self.left: set[Key] = set()                  # still to make (or being made)
        self.ready: dict[Key, Frame] = {}            # made ahead of requests
        self.made_at: dict[Key, float] = {}          # when each ready one was made (time.monotonic)
        self.waiters: dict[Key, list[Sink]] = {}     # requested, not made yet

    @property
    def planned(self) -> bool:
        return self.batches is not None or self.error is not None

    def plan(self, batches: list[list[int]] | None, places: list[list[int]] | None,
             error: BaseException | None) -> None:
        """Its indices are known: the batches to make are those not delivered
        yet (a lost worker's split) and those asked for."""
        if error is not None:
            log.error("cannot compute a split's indices: %s", error,
                      extra=fields(job_id=self.split.job_id, split_id=self.split.split_id))
        self.batches, self.places, self.error = batches, places, error
        delivered = set(self.split.delivered_seqs)
        self.left = {key for key in self.keys if key.seq not in delivered or key in self.waiters}

    def task(self, key: Key, job_path: str) -> Task:
        """What the pool runs to make batch ``key`` (no indices: it is the plan's error)."""
        i = self._offset[key]
        explicit = self.split.batches[i] if self.split.batches else None
        return Task(key, job_path, self.batches[i] if self.error is None else [], self.split.base_seed,
                    explicit is not None and explicit.whole, self.places[i] if self.places else [])

    def start(self, key: Key, pool: BatchPool, job_path: str, worker_address: str, passing: bool = False) -> Future:
        """Makes batch ``key`` in the pool: a future of its frame, which is
        the batch's error where it failed (``passing``: it may pass a busy
        process). RuntimeError: the pool is closing."""
        task = self.task(key, job_path)
        made: Future = Future()
        if self.error is not None:
            made.set_result(crash_frame(task, self.error, worker_address, stage="plan"))
            return made

        def done(future: Future) -> None:
            try:
                frame = future.result()
            except Exception as e:  # noqa: BLE001 - the batch's error, reported to its consumer
                where = fields(job_id=key.job_id, consumer=key.consumer_index, epoch=key.epoch, seq=key.seq)
                if pool.closed:  # a drain past --drain-timeout: no error, the split is re-planned
                    log.info("batch abandoned: the pool is closing (%s)", e, extra=where)
                else:
                    log.error("batch failed in the pool: %s", e, extra=where)
                frame = crash_frame(task, e, worker_address, death=pool.death())
            made.set_result(frame)
        # A consumer's epoch cycles through the processes, as torch's index queues.
        pool.submit(produce, task, lane=key.epoch_key,
                    passing=passing).add_done_callback(done)
        return made

    def take(self, key: Key) -> Frame | None:
        """Batch ``key`` if it is ready, out of the buffer."""
        frame = self.ready.pop(key, None)
        self.made_at.pop(key, None)
        if frame is not None:
            self._budget.taken(self.consumer, shm.size_of(frame))
        return frame

    def request(self, key: Key, sink: Sink) -> bool:
        frame = self.take(key)
        if frame is not None:
            sink(frame)
            return False
        self.waiters.setdefault(key, []).append(sink)
        return True

    def made(self, key: Key, frame: Frame, keep: bool) -> bool:
        """Batch ``key`` is made: to its requests, else into the buffer if
        ``keep``; False: dropped, to be made again (its trainer left)."""
        self.left.discard(key)
        size = shm.size_of(frame)
        sinks = self.waiters.pop(key, None)
        if sinks:
            self._budget.sized(self.consumer, size)
            for sink in sinks:
                sink(frame)
        elif keep:
            self.ready[key] = frame
            self.made_at[key] = time.monotonic()
            self._budget.readied(self.consumer, size)
        else:
            shm.discard(frame)
            self.left.add(key)
            return False
        return True

    def drop(self, key: Key) -> None:
        """A ready batch not kept (evicted, or its consumer went idle): to make again."""
        shm.discard(self.take(key))
        self.left.add(key)

    def cancel(self, sink: Sink) -> None:
        for key in [k for k, sinks in self.waiters.items() if sink in sinks]:
            self.waiters[key] = [s for s in self.waiters[key] if s != sink]
            if not self.waiters[key]:
                del self.waiters[key]

    def unproduced(self) -> int:
        return len(self.left)

    def release(self) -> None:
        for key in list(self.ready):
            shm.discard(self.take(key))
        for key, sinks in self.waiters.items():
            for sink in sinks:
                sink(not_assigned_frame(key))
        self.waiters.clear()
        self.left.clear()

    def close(self) -> None:
        """Nothing runs for it alone: a batch the pool is making is dropped when done."""


class Held:
    """The splits a worker holds, by split id and by batch, and the requests
    for batches of splits not here yet (the dispatcher's assignment may
    reach the worker after the trainer's request)."""

    def __init__(self) -> None:
        self._by_id: dict[int, SplitRunner] = {}
        self._by_key: dict[Key, MapRunner] = {}
        # IterableDataset streams: ((job, consumer, epoch), attempt) -> (N, {stream k: runner})
        self._streams: dict[tuple[EpochKey, int], tuple[int, dict[int, StreamRunner]]] = {}
        self._unknown: dict[Key, tuple[float, list[Sink]]] = {}  # key -> (asked at, requests)

    def __contains__(self, split_id: int) -> bool:
        return split_id in self._by_id

    def __iter__(self) -> Iterator[SplitRunner]:
        return iter(list(self._by_id.values()))

    def ids(self) -> list[int]:
        return list(self._by_id)

    def get(self, split_id: int) -> SplitRunner | None:
        return self._by_id.get(split_id)

    def holds(self, runner: SplitRunner) -> bool:
        """The runner's split is held here (not released meanwhile)."""
        return self._by_id.get(runner.split.split_id) is runner

    def pooled(self, consumer: Consumer | None = None) -> list[MapRunner]:
        """The map runners (of ``consumer``, if given)."""
        return [r for r in self._by_id.values() if r.pooled and (consumer is None or r.consumer == consumer)]

    def add(self, runner: SplitRunner) -> None:
        """Holds the split; the requests that came before it go to its runner."""
        split = runner.split
        self._by_id[split.split_id] = runner
        if split.num_streams:
            group = (EpochKey(split.job_id, split.consumer_index, split.epoch), split.attempt)
            self._streams.setdefault(group, (split.num_streams, {}))[1][split.first_seq] = runner
        else:
            self._by_key.update((key, runner) for key in runner.keys)
        for key in [k for k in self._unknown if self.find(k) is runner]:
            for sink in self._unknown.pop(key)[1]:
                runner.request(key, sink)

    def pop(self, split_id: int) -> SplitRunner | None:
        runner = self._by_id.pop(split_id, None)
        if runner is None:
            return None
        split = runner.split
        # Only what is still this runner's: a split that replaced it (its epoch begun again, the same
        # keys) may have been added before this one was released.
        if split.num_streams:
            group = (EpochKey(split.job_id, split.consumer_index, split.epoch), split.attempt)
            by_stream = self._streams.get(group, (0, {}))[1]
            if by_stream.get(split.first_seq) is runner:
                del by_stream[split.first_seq]
            if not by_stream:
                self._streams.pop(group, None)
        else:
            for key in runner.keys:
                if self._by_key.get(key) is runner:
                    del self._by_key[key]
        return runner

    def find(self, key: Key) -> SplitRunner | None:
        """The runner of batch ``key``, if its split is held here."""
        runner = self._by_key.get(key)
        if runner is not None:
            return runner
        n, by_stream = self._streams.get((key.epoch_key, key.attempt), (0, {}))
        return by_stream.get(seqs.stream_of(key.seq, n)[0]) if n else None

    def waited(self, key: Key) -> bool:
        """A request waits for batch ``key`` of a map split here."""
        runner = self._by_key.get(key)
        return runner is not None and key in runner.waiters

    # ---- requests for splits not here yet --------------------------------------------
    def wait(self, key: Key, sink: Sink, now: float) -> None:
        """A request for a batch of a split not here (yet)."""
        self._unknown.setdefault(key, (now, []))[1].append(sink)

    @property
    def waiting(self) -> bool:
        return bool(self._unknown)

    def expire(self, asked_before: float) -> None:
        """Requests whose split did not come in time are told it is not here."""
        for key, (asked, sinks) in list(self._unknown.items()):
            if asked < asked_before:
                del self._unknown[key]
                for sink in sinks:
                    sink(not_assigned_frame(key))

    def cancel(self, sink: Sink) -> None:
        """Forgets a closed Fetch stream's requests, here and in every runner."""
        for runner in self._by_id.values():
            runner.cancel(sink)
        for key in [k for k, (_, sinks) in self._unknown.items() if sink in sinks]:
            asked, sinks = self._unknown[key]
            sinks = [s for s in sinks if s != sink]
            if sinks:
                self._unknown[key] = (asked, sinks)
            else:
                del self._unknown[key]


class StreamRunner:
    """An IterableDataset stream's split: the daemon's side of its process.
    Grants credits, holds what arrived, answers requests itself; frames
    below the first request are skipped (a stream re-run after a failure
    starts again from its first batch). It takes none of the pool's
    capacity."""

    pooled = False
    planned = True

    def __init__(self, split: dpb.Split, job_path: str, worker_address: str, buffer_batches: int,
                 made: Made | None = None) -> None:
        self.split = split
        self._made = made
        self.consumer = (split.job_id, split.consumer_index)
        self._split = dict(job_id=split.job_id, consumer_index=split.consumer_index, epoch=split.epoch,
                           stream=split.first_seq, num_streams=split.num_streams, base_seed=split.base_seed,
                           next=split.stream_next, state=split.stream_state, replica=split.stream_replica,
                           attempt=split.attempt)
        self._buffer = buffer_batches
        self._cond = threading.Condition()
        self._ready: dict[int, bytes] = {}
        self._waiters: dict[int, list[Sink]] = {}
        self._end: int | None = None
        self._replica = b""  # what the stream's end marker carries (a job that keeps its dataset)
        self._granted = self._received = split.stream_next  # batches before it were delivered
        self._floor: int | None = None
        self._closed = False
        context = stream.stream_context(os.path.dirname(job_path))
        self._conn, child = context.Pipe()
        self._process = context.Process(target=stream.run_stream, args=(self._split, job_path, worker_address, child),
                                        name=f"dpex-stream-{split.first_seq}")
        self._process.start()
        child.close()
        self._thread = threading.Thread(target=self._receive, name="dpex-stream-recv")
        self._thread.start()

    def _end_frame(self, j: int) -> bytes:
        return build_frame(stream.meta(self._split, j, end_of_stream=True, stream_state=self._replica))

    def request(self, key: Key, sink: Sink) -> bool:
        j = seqs.stream_of(key.seq, self.split.num_streams)[1]
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
        return False

    def unproduced(self) -> int:
        return 0

    def release(self) -> None:
        """Requests that wait are told the split is not here; :meth:`close` stops the process."""
        with self._cond:
            waiting, self._waiters = self._waiters, {}
        for j, sinks in waiting.items():
            key = Key(self.split.epoch, seqs.stream_seq(self.split.first_seq, j, self.split.num_streams),
                      self.split.consumer_index, self.split.job_id, self.split.attempt)
            for sink in sinks:
                sink(not_assigned_frame(key))

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
        since = time.monotonic()
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
                if self._made is not None and not meta.end_of_stream:  # since the last: the stream's pace
                    now = time.monotonic()
                    self._made(len(frame), now - since, errors.kind_of(meta.error) if meta.HasField("error") else None)
                    since = now
                if meta.end_of_stream:
                    self._end, self._replica = j, meta.stream_state
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
        """Stops the stream's process (it may take a moment)."""
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
