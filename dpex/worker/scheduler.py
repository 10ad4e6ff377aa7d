"""Runs the worker's pool on the splits it holds (one runner each,
dpex.worker.runners), making next the batch dpex.worker.picking chooses.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py.

Batches a trainer has requested come first (they are what it waits for);
then batches made ahead of requests, each consumer up to ``buffer_batches``
of them and its equal share of ``buffer_bytes`` (dpex.worker.budget); a
batch asked for while it runs ahead leaves the read-ahead for the trainer's
window, so one consumer can have its window plus its read-ahead running.
Turns go round the jobs that have demand (dpex.worker.queues). So memory is
bounded by ``buffer_bytes`` plus the trainers' request windows, and a slow,
paused or departed consumer holds only its own share: the others keep
making ahead.

A consumer whose Fetch streams have all closed (its trainer left or died) is
idle: what it held ready is dropped at once, and nothing is made ahead for it
until it asks again.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from typing import Callable

from dpex.proto import dispatcher_pb2 as dpb
from dpex import errors, shm
from dpex.worker import capacity, picking
from dpex.worker.budget import Budget, Consumer
from dpex.worker.meter import Meter
from dpex.worker.planner import Planner
from dpex.worker.pool import BatchPool
from dpex.worker.queues import Queues
from dpex.worker import runners
from dpex.wire.batchkey import Key
from dpex.wire.frame import error_of
from dpex.worker.runners import Frame, Held, MapRunner, Sink, SplitRunner
from dpex.worker.samples import tiers_bytes
from dpex.worker.sharing import Shared, content_key
from dpex.log import fields

log = logging.getLogger("dpex.worker")


class Scheduler:
    def __init__(self, pool: BatchPool, job_path: Callable[[int], str], *, buffer_batches: int,
                 max_inflight: int, worker_address: str, meter: Meter | None = None,
                 unknown_grace_s: float = 5.0, buffer_bytes: int = 1 << 30,
                 out_of_order: Callable[[int], bool] = lambda job_id: False,
                 share_digest: Callable[[int], bytes | None] = lambda job_id: None,
                 share_bytes: int = 0, sample_dirs: tuple[str, ...] = ()) -> None:
        """``out_of_order(job_id)``: the job's batches may pass a busy batch
        process. ``share_digest(job_id)``: the definition the job shares with
        others (None: none); their equal batches are made once, and kept for
        each other up to ``share_bytes`` (0: nothing is shared; dpex.worker.sharing)."""
        self._pool = pool
        self._out_of_order = out_of_order
        self._share_digest = share_digest
        self._sample_dirs = sample_dirs  # the sample cache's tiers (dpex.worker.samples), for load()
        self.shared = Shared(share_bytes, pool.make_frame) if share_bytes > 0 else None
        self.meter = meter or Meter(max_inflight)
        self._job_path = job_path
        self._buffer = buffer_batches
        self._budget = Budget(buffer_batches, buffer_bytes)
        self._max_inflight = max_inflight
        self._address = worker_address
        self._grace_s = unknown_grace_s
        self._cond = threading.Condition()  # guards every field below, and the runners' and budget's state
        self._held = Held()                             # guarded by _cond
        self._queues = Queues()                         # guarded by _cond
        # guarded by _cond: being made by the pool, for which split's runner (a split released and
        # replaced, its epoch begun again, may have a successor of the same keys: made again for it)
        self._running: dict[Key, SplitRunner] = {}
        self._ahead: set[Key] = set()                   # guarded by _cond: running keys started before any request
        self._following: set[Key] = set()               # guarded by _cond: running keys another job's making makes
        self._saturated: set[Consumer] = set()          # guarded by _cond: as free_capacity() last said
        self._closed = False                            # guarded by _cond
        self._planner: Planner[MapRunner] = Planner(lambda runner: runner.split, self._holds, self._planned)
        self.on_capacity: Callable[[], None] = lambda: None  # a held split has nothing left to produce
        self._thread = threading.Thread(target=self._run, name="dpex-scheduler")
        self._thread.start()

    # ---- per-consumer queues -------------------------------------------------------
    def _forget_if_unused(self, consumer: Consumer) -> None:
        """Drops a consumer's queue once nothing of it is here, streams aside."""
        if not any(runner.consumer == consumer for runner in self._held):
            self._queues.forget_if_unused(consumer, self._budget)

    def _enqueue(self, runner: MapRunner, keys) -> None:
        queue = self._queues.of(runner.consumer)
        for key in keys:
            queue.add(key, urgent=key in runner.waiters)

    def _drop_ready(self, consumer: Consumer, keep: int = 0) -> int:
        """Frees a consumer's ready batches beyond its ``keep`` lowest, to make again; how many."""
        ready = sorted((key, runner) for runner in self._held.pooled(consumer) for key in runner.ready)[keep:]
        for key, runner in ready:
            runner.drop(key)
            self._enqueue(runner, [key])
        return len(ready)

    # ---- splits from the dispatcher --------------------------------------------
    def add_split(self, split: dpb.Split) -> None:
        with self._cond:
            if split.split_id in self._held:
                return
            runner = runners.make(split, self._job_path(split.job_id), self._address, self._buffer, self._budget,
                                  made=self.meter.produced)
            if runner.pooled:
                self._queues.of(runner.consumer)
            self._held.add(runner)
        if runner.pooled:
            self._planner.plan(runner)

    def _holds(self, runner: SplitRunner) -> bool:
        """The split is still held here (not released meanwhile)."""
        with self._cond:
            return self._held.holds(runner)

    def _planned(self, runner: MapRunner, batches: list[list[int]] | None, places: list[list[int]] | None,
                 error: BaseException | None) -> None:
        """A split's indices are known: its batches may be produced."""
        with self._cond:
            if not self._held.holds(runner):
                return  # released meanwhile
            runner.plan(batches, places, error)
            self._enqueue(runner, runner.left)
            self._cond.notify_all()
            if runner.consumer in self._saturated:  # reported waiting for its draw: it may take splits again
                self._saturated.discard(runner.consumer)
                self.on_capacity()

    def release(self, split_ids) -> None:
        with self._cond:
            released = [runner for runner in map(self._held.pop, split_ids) if runner is not None]
            for runner in released:
                runner.release()
                queue = self._queues.get(runner.consumer)
                if queue is not None and runner.pooled:  # but a successor's of the same keys (dpex.worker.runners.Held)
                    queue.todo.difference_update(k for k in runner.keys if self._held.find(k) is None)
            for consumer in {runner.consumer for runner in released}:
                self._forget_if_unused(consumer)
            if self.shared is not None:
                held = {runner.split.job_id for runner in self._held}
                for job_id in {runner.split.job_id for runner in released} - held:
                    self.shared.forget_job(job_id)
            self._cond.notify_all()
        for runner in released:  # outside the lock: a stream process may take a moment to stop
            runner.close()

    def release_all(self) -> None:
        self.release(self.held_split_ids())

    def held_split_ids(self) -> list[int]:
        with self._cond:
            return self._held.ids()

    def free_capacity(self, max_held_splits: int, record: bool = True) -> tuple[int, list[Consumer]]:
        """How many more splits to take, and the consumers to take none of
        (dpex.worker.capacity). ``record``: this is what the worker reports
        (else a question only)."""
        with self._cond:
            want, saturated = capacity.wanted(self._held, self._queues, self._budget, self._queues.active(self._budget),
                                              max_held_splits=max_held_splits, max_inflight=self._max_inflight)
            if record:
                self._saturated = saturated
            return want, sorted(saturated)

    def depth(self) -> tuple[int, int]:
        with self._cond:
            return sum(len(runner.ready) for runner in self._held.pooled()), len(self._running)

    def holdings(self) -> dict[Consumer, tuple[int, int]]:
        """(batches, bytes) held ready, by consumer with a queue here."""
        with self._cond:
            return {c: (self._budget.holding(c).ready, self._budget.holding(c).ready_bytes)
                    for c in self._queues}

    def load(self) -> dpb.WorkerLoad:
        """The worker's counters with its buffered and running batches now."""
        ready, running = self.depth()
        load = self.meter.load(buffer_batches=ready, running_batches=running)
        if self.shared is not None:
            load.share_hits, load.share_misses, load.share_bytes = (self.shared.hits, self.shared.misses,
                                                                    self.shared.bytes)
        load.sample_cache_bytes = tiers_bytes(self._sample_dirs)
        return load

    # ---- requests from trainers ----------------------------------------------------
    def request(self, key: Key, sink: Sink) -> None:
        with self._cond:
            runner = self._held.find(key)
            if runner is not None and not runner.pooled:
                runner.request(key, sink)
                return
            queue = self._queues.open(key.consumer, sink)
            if runner is None:
                self._held.wait(key, sink, time.monotonic())
                self._cond.notify_all()
                return
            made_at = runner.made_at.get(key)
            if not runner.request(key, sink):  # it was ready
                self.meter.queued(time.monotonic() - made_at if made_at is not None else 0.0)
                self._read_ahead_freed(key.consumer)
            elif self._running.get(key) is runner:
                if key in self._ahead:  # asked for now: the trainer's window holds it, not the read-ahead
                    self._ahead.discard(key)
                    self._budget.stopped(key.consumer)
                    self._read_ahead_freed(key.consumer)
            elif runner.planned:
                # Pending, or sent before and asked again: make it first (unplanned: _planned will).
                queue.add(key, urgent=True)
                self._cond.notify_all()

    def _read_ahead_freed(self, consumer: Consumer) -> None:
        """A consumer's read-ahead has room again: make ahead for it; if it was
        reported saturated with nothing left to make here, let the worker take
        its splits again now (else it asks once they are all made)."""
        self._cond.notify_all()
        queue = self._queues.get(consumer)
        if consumer in self._saturated and (queue is None or not queue.todo):
            self._saturated.discard(consumer)
            self.on_capacity()

    def cancel(self, sink: Sink) -> None:
        """Forgets a closed stream's outstanding requests. A consumer left with
        no open stream is idle: its ready batches are freed now."""
        with self._cond:
            self._held.cancel(sink)
            for consumer in self._queues.close(sink):
                dropped = self._drop_ready(consumer)
                if dropped:
                    log.debug("consumer left; freed its ready batches",
                              extra=fields(job_id=consumer[0], consumer=consumer[1], batches=dropped))
                self._forget_if_unused(consumer)
            self._cond.notify_all()

    # ---- production ------------------------------------------------------------------
    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                self._held.expire(time.monotonic() - self._grace_s)
                making = len(self._running) - len(self._following)  # batches in the pool
                key = picking.next_key(self._queues, self._budget, self._held, self._running,
                                       self._drop_ready) if making < self._max_inflight else None
                if key is None:
                    self._cond.wait(0.5 if self._held.waiting else None)
                    continue
                self._queues.of(key.consumer).todo.discard(key)
                runner = self._held.find(key)
                if key not in runner.waiters:
                    self._ahead.add(key)
                    self._budget.started(key.consumer)
                try:
                    made = self._start(runner, key)
                except RuntimeError:  # closing
                    return
                self._running[key] = runner
                self.meter.running(len(self._running))
                made.add_done_callback(lambda f, key=key, runner=runner, started=time.monotonic():
                                       self._done(runner, key, f.result(), started))

    def _start(self, runner: MapRunner, key: Key) -> Future:
        """Makes batch ``key``: from a batch of equal content that another job
        made or is making here, if it shares one; else in the pool (the caller holds _cond)."""
        make = functools.partial(runner.start, key, self._pool, self._job_path(key.job_id), self._address,
                                 passing=self._out_of_order(key.job_id))
        digest = self._share_digest(key.job_id) if self.shared is not None and runner.planned else None
        if digest is None or runner.error is not None:
            return make()
        # Kept only for the jobs that may ask for it: of this definition, reading this epoch of this base
        # seed (a sweep's trial of another seed never does: its batches are others, issue 55).
        mine = runner.split
        made, following = self.shared.make(content_key(digest, runner.task(key, "")), key, make, lambda: {
            r.split.job_id for r in self._held.pooled() if r.split.job_id != key.job_id
            and r.split.epoch == mine.epoch and r.split.base_seed == mine.base_seed
            and self._share_digest(r.split.job_id) == digest})
        if following:
            self._following.add(key)
        return made

    def _done(self, runner: MapRunner, key: Key, frame: Frame, started: float) -> None:
        error = error_of(frame)
        self.meter.produced(shm.size_of(frame), time.monotonic() - started,
                            None if error is None else errors.kind_of(error))
        with self._cond:
            if self._running.get(key) is runner:
                del self._running[key]
            self._following.discard(key)
            self.meter.running(len(self._running))
            if key in self._ahead:
                self._ahead.discard(key)
                self._budget.stopped(key.consumer)
            self._cond.notify_all()
            if not self._held.holds(runner):
                shm.discard(frame)
                successor = self._held.find(key)
                if (successor is not None and successor.pooled and key not in self._running
                        and key in successor.left):
                    self._enqueue(successor, [key])  # its queue dropped the key while this one was made
                self._forget_if_unused(key.consumer)
                return  # released meanwhile
            queue = self._queues.get(key.consumer)
            if not runner.made(key, frame, keep=queue is None or not queue.idle):
                self._enqueue(runner, [key])  # its trainer left meanwhile: make it again if asked
            if not runner.unproduced():
                self.on_capacity()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            runners = list(self._held)
        for runner in runners:
            runner.close()
        self._thread.join()
        self._planner.close()
