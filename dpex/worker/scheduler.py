"""Decides which batch the worker's processes produce next.

Batches a trainer has requested come first (they are what it waits for);
then batches produced ahead of requests, each consumer up to
``buffer_batches`` of them and its equal share of ``buffer_bytes``
(dpex.worker.budget); a batch asked for while it runs ahead leaves the
read-ahead for the trainer's window, so one consumer can have its window
plus its read-ahead running. Turns go round the jobs that have demand. So memory is
bounded by ``buffer_bytes`` plus the trainers' request windows, and a slow,
paused or departed consumer holds only its own share: the others keep
producing ahead.

A consumer whose Fetch streams have all closed (its trainer left or died) is
idle: what it held ready is dropped at once, and nothing is made ahead for it
until it asks again.
"""
from __future__ import annotations

import heapq
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from dpex.plan import seq as seqs
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import worker_pb2 as wpb
from dpex.wire import build_frame
from dpex import shm
from dpex.worker.budget import Budget, Consumer, Turns
from dpex.worker.meter import Meter
from dpex.worker.planner import Planner
from dpex.worker.pool import BatchPool, crash_frame
from dpex.worker.runtime import Task, produce
from dpex.worker.stream import StreamRunner
from dpex.log import fields

log = logging.getLogger("dpex.worker")

Frame = "bytes | shm.Handoff"  # a Handoff: the frame lies in a /dev/shm file (dpex.shm)
Sink = Callable[[Frame], None]


class Key(NamedTuple):
    """A batch id, ordered as the dispatcher orders splits."""
    epoch: int
    seq: int
    consumer_index: int
    job_id: int

    @property
    def consumer(self) -> Consumer:
        return (self.job_id, self.consumer_index)


@dataclass
class _Split:
    split: dpb.Split
    unproduced: set[Key] = field(default_factory=set)
    batches: list[list[int]] | None = None  # None: being computed from the epoch's sampler
    places: list[list[int]] | None = None   # each batch's samples' places (dpex.seeding); [] where not sent
    error: BaseException | None = None      # they could not be: each batch is this error

    @property
    def planned(self) -> bool:
        """Its indices are known (or known to be an error): its batches may be produced."""
        return self.batches is not None or self.error is not None


@dataclass
class _Queue:
    """One consumer's batches still to produce here, and its open streams."""
    todo: set[Key] = field(default_factory=set)
    pending: list[Key] = field(default_factory=list)  # heap over todo, lazily cleaned
    urgent: list[Key] = field(default_factory=list)   # heap of requested todo keys, lazily cleaned
    sinks: set = field(default_factory=set)           # Fetch streams that asked for its batches
    idle: bool = False                                # its streams all closed: nothing ahead

    def add(self, key: Key, urgent: bool) -> None:
        if key not in self.todo:
            self.todo.add(key)
            heapq.heappush(self.pending, key)
        if urgent:
            heapq.heappush(self.urgent, key)

    def head(self, heap: list[Key], ok: Callable[[Key], bool]) -> Key | None:
        """The lowest key of ``heap`` still to do and ``ok``; stale ones are dropped."""
        while heap:
            if heap[0] in self.todo and ok(heap[0]):
                return heap[0]
            heapq.heappop(heap)
        return None


def split_keys(split: dpb.Split) -> list[Key]:
    """The batch ids of a (map-style) split, in order."""
    return [Key(split.epoch, s, split.consumer_index, split.job_id)
            for s in seqs.split_seqs(split.first_seq, split.num_batches or len(split.batches))]


def not_assigned_frame(key: Key) -> bytes:
    return build_frame(wpb.Batch(job_id=key.job_id, consumer_index=key.consumer_index,
                                 epoch=key.epoch, seq=key.seq, not_assigned=True))


class Scheduler:
    def __init__(self, pool: BatchPool, job_path: Callable[[int], str], *, buffer_batches: int,
                 max_inflight: int, worker_address: str, meter: Meter | None = None,
                 unknown_grace_s: float = 5.0, buffer_bytes: int = 1 << 30) -> None:
        self._pool = pool
        self.meter = meter or Meter(max_inflight)
        self._job_path = job_path
        self._buffer = buffer_batches
        self._budget = Budget(buffer_batches, buffer_bytes)
        self._turns = Turns()
        self._max_inflight = max_inflight
        self._address = worker_address
        self._grace_s = unknown_grace_s
        self._cond = threading.Condition()
        self._splits: dict[int, _Split] = {}
        self._where: dict[Key, tuple[int, int]] = {}    # key -> (split id, offset)
        self._queues: dict[Consumer, _Queue] = {}
        self._of_job: dict[int, set[Consumer]] = {}
        self._running: dict[Key, Future] = {}
        self._ahead: set[Key] = set()                   # running keys started before any request
        self._saturated: set[Consumer] = set()          # as free_capacity() last said
        self._ready: dict[Key, Frame] = {}
        self._waiters: dict[Key, list[Sink]] = {}
        self._unknown_since: dict[Key, float] = {}      # requested before its split arrived
        # IterableDataset streams: (job, consumer, epoch) -> (N, {stream k: runner})
        self._streams: dict[tuple[int, int, int], tuple[int, dict[int, StreamRunner]]] = {}
        self._closed = False
        self._planner: Planner[_Split] = Planner(lambda entry: entry.split, self._held, self._planned)
        self.on_capacity: Callable[[], None] = lambda: None  # a held split has nothing left to produce
        self._thread = threading.Thread(target=self._run, name="dpex-scheduler")
        self._thread.start()

    # ---- per-consumer queues -------------------------------------------------------
    def _queue(self, consumer: Consumer) -> _Queue:
        q = self._queues.get(consumer)
        if q is None:
            q = self._queues[consumer] = _Queue()
            self._of_job.setdefault(consumer[0], set()).add(consumer)
            self._turns.add(consumer[0])
        return q

    def _forget_if_unused(self, consumer: Consumer) -> None:
        """Drops a consumer's queue once nothing of it is here (streams aside:
        a new split finds the consumer as it is now)."""
        q = self._queues.get(consumer)
        if q is None or q.todo or q.sinks or self._budget.holding(consumer).batches:
            return
        if any((e.split.job_id, e.split.consumer_index) == consumer for e in self._splits.values()):
            return
        del self._queues[consumer]
        self._budget.forget(consumer)
        jobs = self._of_job.get(consumer[0], set())
        jobs.discard(consumer)
        if not jobs:
            self._of_job.pop(consumer[0], None)
            self._turns.remove(consumer[0])

    def _active(self) -> int:
        """Consumers sharing the buffer: those with work to make ahead or batches held."""
        return sum(1 for c, q in self._queues.items()
                   if (q.todo and not q.idle) or self._budget.holding(c).batches)

    def _take_ready(self, key: Key) -> Frame | None:
        frame = self._ready.pop(key, None)
        if frame is not None:
            self._budget.taken(key.consumer, shm.size_of(frame))
        return frame

    def _requeue(self, key: Key) -> None:
        """A batch made but not kept (evicted, or its consumer went idle): to do again."""
        entry = self._splits[self._where[key][0]]
        entry.unproduced.add(key)
        self._queue(key.consumer).add(key, urgent=key in self._waiters)

    def _drop_ready(self, consumer: Consumer, keep: int = 0) -> int:
        """Frees a consumer's ready batches beyond its ``keep`` lowest; how many."""
        keys = sorted(k for k in self._ready if k.consumer == consumer)[keep:]
        for key in keys:
            shm.discard(self._take_ready(key))
            self._requeue(key)
        return len(keys)

    # ---- splits from the dispatcher --------------------------------------------
    def _stream_of(self, key: Key) -> tuple[StreamRunner | None, int]:
        n, runners = self._streams.get((key.job_id, key.consumer_index, key.epoch), (0, {}))
        if not n:
            return None, 0
        stream, j = seqs.stream_of(key.seq, n)
        return runners.get(stream), j

    def _add_stream(self, split: dpb.Split) -> None:
        runner = StreamRunner(split, self._job_path(split.job_id), self._address, self._buffer)
        group = (split.job_id, split.consumer_index, split.epoch)
        self._streams.setdefault(group, (split.num_streams, {}))[1][split.first_seq] = runner
        self._splits[split.split_id] = _Split(split)  # nothing to produce here: no capacity used
        for key in [k for k in self._waiters if (k.job_id, k.consumer_index, k.epoch) == group
                    and seqs.stream_of(k.seq, split.num_streams)[0] == split.first_seq]:
            self._unknown_since.pop(key, None)
            for sink in self._waiters.pop(key):
                runner.request(seqs.stream_of(key.seq, split.num_streams)[1], sink)

    def add_split(self, split: dpb.Split) -> None:
        with self._cond:
            if split.split_id in self._splits:
                return
            if split.num_streams:
                self._add_stream(split)
                return
            entry = _Split(split)
            self._queue((split.job_id, split.consumer_index))
            for i, key in enumerate(split_keys(split)):
                self._where[key] = (split.split_id, i)
                self._unknown_since.pop(key, None)
            self._splits[split.split_id] = entry
            if not split.HasField("sampler"):
                self._planned(entry, [list(b.indices) for b in split.batches],
                              places=[list(b.places) for b in split.batches])
                return
        self._planner.plan(entry)

    def _held(self, entry: _Split) -> bool:
        """The split is still held here (not released meanwhile)."""
        with self._cond:
            return self._splits.get(entry.split.split_id) is entry

    def _planned(self, entry: _Split, batches: list[list[int]] | None, places: list[list[int]] | None = None,
                 error: BaseException | None = None) -> None:
        """A split's indices are known: its batches may be produced."""
        with self._cond:
            split = entry.split
            if self._splits.get(split.split_id) is not entry:
                return  # released meanwhile
            if error is not None:
                log.error("cannot compute a split's indices: %s", error,
                          extra=fields(job_id=split.job_id, split_id=split.split_id))
            entry.batches, entry.error, entry.places = batches, error, places
            consumer = (split.job_id, split.consumer_index)
            queue = self._queue(consumer)
            delivered = set(split.delivered_seqs)  # a lost worker's split: only what is left
            for key in split_keys(split):
                if key.seq in delivered and key not in self._waiters:
                    continue
                entry.unproduced.add(key)
                queue.add(key, urgent=key in self._waiters)
            self._cond.notify_all()
            if consumer in self._saturated:  # reported waiting for its draw: it may take splits again
                self._saturated.discard(consumer)
                self.on_capacity()

    def release(self, split_ids) -> None:
        runners = []
        with self._cond:
            touched: set[Consumer] = set()
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
                touched.add((split.job_id, split.consumer_index))
                queue = self._queues.get((split.job_id, split.consumer_index))
                for key in split_keys(split):
                    self._where.pop(key, None)
                    shm.discard(self._take_ready(key) or b"")
                    if queue is not None:
                        queue.todo.discard(key)
                    for sink in self._waiters.pop(key, []):
                        sink(not_assigned_frame(key))
            for consumer in touched:
                self._forget_if_unused(consumer)
            self._cond.notify_all()
        for runner in runners:  # outside the lock: a stream process may take a moment to stop
            if runner is not None:
                runner.close()

    def release_all(self) -> None:
        self.release(list(self._splits))

    def held_split_ids(self) -> list[int]:
        with self._cond:
            return list(self._splits)

    def free_capacity(self, max_held_splits: int, record: bool = True) -> tuple[int, list[Consumer]]:
        """How many more splits to take, and the consumers to take none of.

        Held splits with batches still to produce count, unless their consumer
        is saturated: it holds its whole share, or its trainer left (idle). A
        slow consumer's splits must not keep the other jobs' out, and the
        worker must not take more of them either. Produced ones wait in the
        bounded buffer, and must not stop the worker from taking the split a
        trainer waits for. A consumer whose split waits for its epoch's
        permutation to be drawn takes one split's room and no more splits
        until it is drawn (a draw of 10^8 samples takes seconds).

        Past ``max_held_splits``, one more split at a time while the held ones
        have fewer batches left than the pool runs at once: small splits
        must not leave a many-process worker's processes idle. ``record``: this
        is what the worker reports (else a question only)."""
        with self._cond:
            active = self._active()
            drawing = {(e.split.job_id, e.split.consumer_index) for e in self._splits.values() if not e.planned}
            saturated = drawing | {c for c, q in self._queues.items()
                                   if q.idle or not self._budget.room(c, active)}
            if record:
                self._saturated = saturated
            busy = [e for e in self._splits.values()
                    if e.unproduced and (e.split.job_id, e.split.consumer_index) not in saturated]
            want = max_held_splits - len(drawing) - len(busy)
            if want <= 0 and not drawing and sum(len(e.unproduced) for e in busy) < self._max_inflight:
                want = 1
            return max(0, want), sorted(saturated)

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return len(self._ready), len(self._running)

    def held_by(self, job_id: int, consumer_index: int) -> tuple[int, int]:
        """(batches, bytes) a consumer holds ready here."""
        with self._cond:
            h = self._budget.holding((job_id, consumer_index))
            return h.ready, h.ready_bytes

    def holdings(self) -> dict[Consumer, tuple[int, int]]:
        """(batches, bytes) held ready, by consumer with a queue here."""
        with self._cond:
            return {c: (self._budget.holding(c).ready, self._budget.holding(c).ready_bytes)
                    for c in self._queues}

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
            queue = self._queue(key.consumer)
            queue.sinks.add(sink)
            queue.idle = False
            frame = self._take_ready(key)
            if frame is not None:
                sink(frame)
                self._read_ahead_freed(key.consumer)
                return
            self._waiters.setdefault(key, []).append(sink)
            if key in self._running:
                if key in self._ahead:  # asked for now: the trainer's window holds it, not the read-ahead
                    self._ahead.discard(key)
                    self._budget.stopped(key.consumer)
                    self._read_ahead_freed(key.consumer)
                return
            if key in self._where:
                # Pending, or sent before and asked again: (re)produce it first
                # (once its indices are known: _planned queues the waited ones).
                if self._splits[self._where[key][0]].planned:
                    queue.add(key, urgent=True)
            else:
                self._unknown_since.setdefault(key, time.monotonic())
            self._cond.notify_all()

    def _read_ahead_freed(self, consumer: Consumer) -> None:
        """A consumer's read-ahead has room again: produce ahead for it; if it
        was last reported saturated and has nothing left to produce here, let
        the worker take its splits again now. (With batches left, the room is
        used on them, and the worker asks once they are all made.)"""
        self._cond.notify_all()
        queue = self._queues.get(consumer)
        if consumer in self._saturated and (queue is None or not queue.todo):
            self._saturated.discard(consumer)
            self.on_capacity()

    def cancel(self, sink: Sink) -> None:
        """Forgets a closed stream's outstanding requests. A consumer left with
        no open stream is idle: its ready batches are freed now."""
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
            for consumer, q in list(self._queues.items()):
                if sink in q.sinks:
                    q.sinks.discard(sink)
                    if not q.sinks:
                        q.idle = True
                        dropped = self._drop_ready(consumer)
                        if dropped:
                            log.debug("consumer left; freed its ready batches",
                                      extra=fields(job_id=consumer[0], consumer=consumer[1], batches=dropped))
                        self._forget_if_unused(consumer)
            self._cond.notify_all()

    # ---- production ------------------------------------------------------------------
    def _urgent_of(self, job: int) -> Key | None:
        best = None
        for c in self._of_job.get(job, ()):
            key = self._queues[c].head(self._queues[c].urgent,
                                       lambda k: k in self._waiters and k not in self._running)
            if key is not None and (best is None or key < best):
                best = key
        return best

    def _ahead_of(self, job: int, active: int, blocked: list[Consumer]) -> Key | None:
        """The lowest key of the job's consumers that may make one more ahead;
        consumers with room in their share but not in the whole buffer go to ``blocked``."""
        best = None
        for c in self._of_job.get(job, ()):
            q = self._queues[c]
            if q.idle or not self._budget.room(c, active):
                continue
            key = q.head(q.pending, lambda k: k not in self._running)
            if key is None:
                continue
            if not self._budget.fits(c):
                blocked.append(c)
            elif best is None or key < best:
                best = key
        return best

    def _trim(self, active: int) -> None:
        """Keeps batches made ahead within the memory bound: a newcomer's first
        batch, of a size not known before, may have gone over it."""
        while self._budget.total_bytes() > self._budget.max_bytes:
            victim = self._budget.over_share(active, self._queues)
            if victim is None:
                return
            self._drop_ready(victim, keep=self._budget.holding(victim).ready - 1)

    def _next(self) -> Key | None:
        key = self._turns.pick(self._urgent_of)
        if key is not None:
            return key
        active = self._active()
        self._trim(active)
        blocked: list[Consumer] = []
        key = self._turns.pick(lambda job: self._ahead_of(job, active, blocked))
        if key is not None or not blocked:
            return key
        # The memory is full of batches of consumers over their share (they
        # were alone when they made them): evict one so that a newcomer gets its share.
        victim = self._budget.over_share(active, [c for c in self._queues if c not in blocked])
        if victim is None:
            return None
        self._drop_ready(victim, keep=self._budget.holding(victim).ready - 1)
        return self._turns.pick(lambda job: self._ahead_of(job, active, []))

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
                self._queues[key.consumer].todo.discard(key)
                if key not in self._waiters:
                    self._ahead.add(key)
                    self._budget.started(key.consumer)
                split_id, offset = self._where[key]
                entry = self._splits[split_id]
                explicit = entry.split.batches[offset] if entry.split.batches else None
                task = Task(key.job_id, self._job_path(key.job_id), key.consumer_index, key.epoch,
                            key.seq, entry.batches[offset] if entry.error is None else [],
                            entry.split.base_seed, explicit is not None and explicit.whole,
                            entry.places[offset] if entry.places else [])
                if entry.error is not None:
                    future = Future()
                    future.set_result(crash_frame(task, entry.error, self._address, stage="plan"))
                else:
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
            where = fields(job_id=key.job_id, consumer=key.consumer_index, epoch=key.epoch, seq=key.seq)
            if self._pool.closed:  # a drain past --drain-timeout: no error, the split is re-planned
                log.info("batch abandoned: the pool is closing (%s)", e, extra=where)
            else:
                log.error("batch failed in the pool: %s", e, extra=where)
            frame = crash_frame(task, e, self._address, death=self._pool.death())
        size = shm.size_of(frame)
        self.meter.produced(size)
        with self._cond:
            self._running.pop(key, None)
            self.meter.running(len(self._running))
            if key in self._ahead:
                self._ahead.discard(key)
                self._budget.stopped(key.consumer)
            self._cond.notify_all()
            if key not in self._where:
                shm.discard(frame)
                self._forget_if_unused(key.consumer)
                return  # released meanwhile
            entry = self._splits[self._where[key][0]]
            entry.unproduced.discard(key)
            sinks = self._waiters.pop(key, None)
            queue = self._queues.get(key.consumer)
            if sinks:
                self._budget.sized(key.consumer, size)
                for sink in sinks:
                    sink(frame)
            elif queue is not None and queue.idle:
                shm.discard(frame)  # its trainer left meanwhile: make it again if asked
                self._requeue(key)
            else:
                self._ready[key] = frame
                self._budget.readied(key.consumer, size)
            if not entry.unproduced:
                self.on_capacity()

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
        self._planner.close()
