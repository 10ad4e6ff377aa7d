"""Decides which batch the worker's processes produce next.

Batches a trainer has requested come first (they are what it waits for);
then the lowest pending batch, as long as finished-but-unrequested batches
plus running ones stay within ``buffer_batches``. So memory is bounded by the
buffer plus the trainers' request windows, whatever their speed.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import worker_pb2 as wpb
from dpex.wire import build_frame
from dpex.worker import handoff
from dpex.worker.meter import Meter
from dpex.worker.pool import BatchPool, Task, crash_frame, produce
from dpex.worker.stream import StreamRunner
from dpex.log import fields

log = logging.getLogger("dpex.worker")

Frame = "bytes | handoff.Handoff"  # a Handoff: the frame lies in a /dev/shm file (dpex.worker.handoff)
Sink = Callable[[Frame], None]


class Key(NamedTuple):
    """A batch id, ordered as the dispatcher orders splits."""
    epoch: int
    seq: int
    consumer_index: int
    job_id: int


@dataclass
class _Split:
    split: dpb.Split
    unproduced: set[Key] = field(default_factory=set)


def split_keys(split: dpb.Split) -> list[Key]:
    """The batch ids of a (map-style) split, in order."""
    return [Key(split.epoch, split.first_seq + i, split.consumer_index, split.job_id)
            for i in range(len(split.batches))]


def not_assigned_frame(key: Key) -> bytes:
    return build_frame(wpb.Batch(job_id=key.job_id, consumer_index=key.consumer_index,
                                 epoch=key.epoch, seq=key.seq, not_assigned=True))


class Scheduler:
    def __init__(self, pool: BatchPool, job_path: Callable[[int], str], *, buffer_batches: int,
                 max_inflight: int, worker_address: str, meter: Meter | None = None,
                 unknown_grace_s: float = 5.0) -> None:
        self._pool = pool
        self.meter = meter or Meter(max_inflight)
        self._job_path = job_path
        self._buffer = buffer_batches
        self._max_inflight = max_inflight
        self._address = worker_address
        self._grace_s = unknown_grace_s
        self._cond = threading.Condition()
        self._splits: dict[int, _Split] = {}
        self._where: dict[Key, tuple[int, int]] = {}    # key -> (split id, offset)
        self._pending: list[Key] = []                   # heap; lazily cleaned
        self._pending_set: set[Key] = set()
        self._urgent: list[Key] = []                    # heap of requested pending keys
        self._running: dict[Key, Future] = {}
        self._ready: dict[Key, Frame] = {}
        self._waiters: dict[Key, list[Sink]] = {}
        self._unknown_since: dict[Key, float] = {}      # requested before its split arrived
        # IterableDataset streams: (job, consumer, epoch) -> (N, {stream k: runner})
        self._streams: dict[tuple[int, int, int], tuple[int, dict[int, StreamRunner]]] = {}
        self._closed = False
        self.on_capacity: Callable[[], None] = lambda: None  # a held split has nothing left to produce
        self._thread = threading.Thread(target=self._run, name="dpex-scheduler")
        self._thread.start()

    # ---- splits from the dispatcher --------------------------------------------
    def _stream_of(self, key: Key) -> tuple[StreamRunner | None, int]:
        n, runners = self._streams.get((key.job_id, key.consumer_index, key.epoch), (0, {}))
        return (runners.get(key.seq % n), key.seq // n) if n else (None, 0)

    def _add_stream(self, split: dpb.Split) -> None:
        runner = StreamRunner(split, self._job_path(split.job_id), self._address, self._buffer)
        group = (split.job_id, split.consumer_index, split.epoch)
        self._streams.setdefault(group, (split.num_streams, {}))[1][split.first_seq] = runner
        self._splits[split.split_id] = _Split(split)  # nothing to produce here: no capacity used
        for key in [k for k in self._waiters if (k.job_id, k.consumer_index, k.epoch) == group
                    and k.seq % split.num_streams == split.first_seq]:
            self._unknown_since.pop(key, None)
            for sink in self._waiters.pop(key):
                runner.request(key.seq // split.num_streams, sink)

    def add_split(self, split: dpb.Split) -> None:
        with self._cond:
            if split.split_id in self._splits:
                return
            if split.num_streams:
                self._add_stream(split)
                return
            entry = _Split(split)
            delivered = set(split.delivered_seqs)  # a lost worker's split: only what is left
            for i, key in enumerate(split_keys(split)):
                self._where[key] = (split.split_id, i)
                if key.seq in delivered and key not in self._waiters:
                    continue
                entry.unproduced.add(key)
                self._pending_set.add(key)
                heapq.heappush(self._pending, key)
                if key in self._waiters:
                    heapq.heappush(self._urgent, key)
                    self._unknown_since.pop(key, None)
            self._splits[split.split_id] = entry
            self._cond.notify_all()

    def release(self, split_ids) -> None:
        runners = []
        with self._cond:
            for split_id in split_ids:
                entry = self._splits.pop(split_id, None)
                if entry is None:
                    continue
                split = entry.split
                if split.num_streams:
                    group = (split.job_id, split.consumer_index, split.epoch)
                    _, by_stream = self._streams.get(group, (0, {}))
                    runners.append(by_stream.pop(split.first_seq, None))
                    if not by_stream:
                        self._streams.pop(group, None)
                    continue
                for key in split_keys(split):
                    self._where.pop(key, None)
                    handoff.discard(self._ready.pop(key, b""))
                    self._pending_set.discard(key)
                    for sink in self._waiters.pop(key, []):
                        sink(not_assigned_frame(key))
            self._cond.notify_all()
        for runner in runners:  # outside the lock: a stream process may take a moment to stop
            if runner is not None:
                runner.close()

    def release_all(self) -> None:
        self.release(list(self._splits))

    def held_split_ids(self) -> list[int]:
        with self._cond:
            return list(self._splits)

    def free_capacity(self, max_held_splits: int) -> int:
        """How many more splits to take: held splits with batches still to
        produce count. Produced ones wait in the bounded buffer, and must not
        stop the worker from taking the split a trainer waits for."""
        with self._cond:
            busy = sum(1 for e in self._splits.values() if e.unproduced)
            return max(0, max_held_splits - busy)

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return len(self._ready), len(self._running)

    def load(self) -> dpb.WorkerLoad:
        """The worker's counters with its buffered and running batches now."""
        ready, running = self.depth()
        return self.meter.load(buffer_batches=ready, running_batches=running)

    # ---- requests from trainers ----------------------------------------------------
    def request(self, key: Key, sink: Sink) -> None:
        with self._cond:
            runner, j = self._stream_of(key)
            if runner is not None:
                runner.request(j, sink)
                return
            frame = self._ready.pop(key, None)
            if frame is not None:
                sink(frame)
                self._cond.notify_all()  # a free buffer slot: produce ahead again
                return
            self._waiters.setdefault(key, []).append(sink)
            if key in self._running:
                return
            if key in self._where:
                # Pending, or sent before and asked again: (re)produce it first.
                self._pending_set.add(key)
                heapq.heappush(self._urgent, key)
            else:
                self._unknown_since.setdefault(key, time.monotonic())
            self._cond.notify_all()

    def cancel(self, sink: Sink) -> None:
        """Forgets a closed stream's outstanding requests."""
        with self._cond:
            for _, runners in self._streams.values():
                for runner in runners.values():
                    runner.cancel(sink)
            for key in [k for k, sinks in self._waiters.items() if sink in sinks]:
                sinks = [s for s in self._waiters[key] if s != sink]
                if sinks:
                    self._waiters[key] = sinks
                else:
                    del self._waiters[key]
                    self._unknown_since.pop(key, None)

    # ---- production ------------------------------------------------------------------
    def _next(self) -> Key | None:
        while self._urgent:
            key = heapq.heappop(self._urgent)
            if key in self._pending_set and key in self._waiters and key not in self._running:
                return key
        if len(self._ready) + len(self._running) >= self._buffer:
            return None
        while self._pending:
            key = heapq.heappop(self._pending)
            if key in self._pending_set and key not in self._running:
                return key
        return None

    def _expire_unknown(self) -> None:
        now = time.monotonic()
        for key, since in list(self._unknown_since.items()):
            if now - since > self._grace_s:
                del self._unknown_since[key]
                for sink in self._waiters.pop(key, []):
                    sink(not_assigned_frame(key))

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                self._expire_unknown()
                key = self._next() if len(self._running) < self._max_inflight else None
                if key is None:
                    self._cond.wait(0.5 if self._unknown_since else None)
                    continue
                self._pending_set.discard(key)
                split_id, offset = self._where[key]
                split = self._splits[split_id].split
                task = Task(key.job_id, self._job_path(key.job_id), key.consumer_index, key.epoch,
                            key.seq, list(split.batches[offset].indices), split.base_seed)
                try:
                    future = self._pool.submit(produce, task)
                except RuntimeError:  # closing
                    return
                self._running[key] = future
                self.meter.running(len(self._running))
                future.add_done_callback(lambda f, key=key, task=task: self._done(key, task, f))

    def _done(self, key: Key, task: Task, future: Future) -> None:
        try:
            frame = future.result()
        except Exception as e:
            log.error("batch failed in the pool: %s", e,
                      extra=fields(job_id=key.job_id, consumer=key.consumer_index, epoch=key.epoch, seq=key.seq))
            frame = crash_frame(task, e, self._address)
        self.meter.produced(handoff.size_of(frame))
        with self._cond:
            self._running.pop(key, None)
            self.meter.running(len(self._running))
            self._cond.notify_all()
            if key not in self._where:
                handoff.discard(frame)
                return  # released meanwhile
            entry = self._splits[self._where[key][0]]
            entry.unproduced.discard(key)
            if not entry.unproduced:
                self.on_capacity()
            sinks = self._waiters.pop(key, None)
            if sinks:
                for sink in sinks:
                    sink(frame)
            else:
                self._ready[key] = frame

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            runners = [r for _, rs in self._streams.values() for r in rs.values()]
            self._streams.clear()
        for runner in runners:
            runner.close()
        if self._thread.is_alive():
            self._thread.join()
