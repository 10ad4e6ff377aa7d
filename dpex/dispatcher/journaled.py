"""The dispatcher's state behind one lock, each change journaled before it
takes effect: the base that the request handlers (core), the long polls
(polls), the reaper and status stand on. It recovers the state from the
journal at start and wakes the long polls an update touched."""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from typing import Any, Callable

from dpex.auth import answers
from dpex.config import DispatcherConfig
from dpex.dispatcher.claims import HELD_S, Claims
from dpex.dispatcher.counts import EpochCounts
from dpex.dispatcher.liveness import Liveness
from dpex.dispatcher.planfiles import PlanFiles
from dpex.dispatcher.scaling import Decision, Policy, ScalingConfig
from dpex.dispatcher.state import DispatcherState, Job, Split
from dpex.dispatcher.store import Store
from dpex.dispatcher.waiters import Poll, Waiters
from dpex.keys import JobKeys, Refusals, load_secret
from dpex.errors import GOING_AWAY, JOB_COLLECTED, DpexConnectionError, DpexNotFoundError
from dpex.plan.seq import split_seqs
from dpex.procutil import temp_dir
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")


class Journaled:
    """The state machine, its journal and what is kept beside it (who was
    last heard, which loader holds each consumer, the long polls, plan
    files, the keys). Every field below is guarded by ``lock``, but
    ``config`` and ``stopping``, and ``store``, ``plan_files`` and ``keys``,
    which have locks of their own."""

    def __init__(self, config: DispatcherConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what the liveness tables (heartbeat, consumer and GC
        timeouts) read; the long polls wait in real time."""
        self.config = config
        self.lock = threading.RLock()
        self.state = DispatcherState()         # guarded by lock; changed only through apply()
        self.waiters = Waiters()               # guarded by lock
        self.seen = Liveness(clock)            # guarded by lock
        self.claims = Claims()                 # guarded by lock: which loader holds each consumer
        self.counts = EpochCounts()            # guarded by lock: each consumer's batches (even_batches)
        self.started = time.monotonic()
        self.heartbeats = 0                    # guarded by lock: answered since start (GetStatus)
        self.stopping = threading.Event()      # the long polls end; no new one waits
        # The scaling policy (None: --max-workers 0) and its last decision, guarded by lock.
        self.scaling = (Policy(ScalingConfig(config.min_workers, config.max_workers,
                                             cooldown_s=config.scale_cooldown_s)) if config.max_workers else None)
        self.scaled: Decision | None = None
        self._closed = False                   # guarded by lock: the journal is closed
        self.store = Store(config.work_dir, config.journal_compact_bytes) if config.work_dir else None
        self._own_plan_dir = None if config.work_dir else temp_dir("dispatcher")
        self.plan_files = PlanFiles(os.path.join(config.work_dir, "plans") if config.work_dir
                                    else self._own_plan_dir)
        # Which job or worker a call may touch (dpex.keys); its own lock.
        self.keys = JobKeys(load_secret(config.work_dir), Refusals(log))
        if self.store is not None:
            self._recover()

    def _recover(self) -> None:
        started = time.monotonic()
        self.state = self.store.recover()
        # Recovered workers get a whole timeout to heartbeat again.
        for w in self.state.workers.values():
            self.seen.worker(w.worker_id) if w.alive else self.seen.lost(w.worker_id)
        for job in self.state.jobs.values():
            self.seen.job(job.job_id)
            for c in job.plans:
                self.seen.consumer(job.job_id, c)
        log.info("recovered from %s (snapshot generation %d + %d log records) in %.2fs: %d workers, %d jobs",
                 self.config.work_dir, self.store.generation, self.store.replayed, time.monotonic() - started,
                 len(self.state.alive_workers()), len(self.state.jobs))

    def stop_serving(self) -> None:
        """The first step of a graceful stop: the long polls end now with
        UNAVAILABLE, which clients read as an outage of the dispatcher (they
        retry until it is back); the server stops taking calls next."""
        self.stopping.set()
        with self.lock:
            self.waiters.wake_all()

    def close(self) -> None:
        """Closes the journal (after the server and the reaper stopped: an
        update that still comes is refused as the dispatcher going away)."""
        self.stop_serving()
        with self.lock:
            self._closed = True
            if self.store is not None:
                self.store.close()
        self.plan_files.close()
        if self._own_plan_dir is not None:
            shutil.rmtree(self._own_plan_dir, ignore_errors=True)

    def apply(self, **kind: Any) -> Any:
        """Journals one update, then applies it, and wakes the long polls it
        touched; the caller holds ``lock``."""
        if self._closed:
            raise DpexConnectionError(GOING_AWAY)
        update = jpb.Update(**kind)
        if self.store is not None:
            self.store.append(update)  # written before it takes effect; durable before any answer
        result = self.state.apply(update)
        changes = self.state.take_changes()
        if self.store is not None and self.store.due(changes.plans_ended > 0):
            self.store.compact(self.state)  # the log restarts from a snapshot of the live state
        self.waiters.wake(changes)
        return result

    async def wait(self, poll: Poll, timeout: float) -> None:
        """Waits (the lock not held) for a long poll to be woken or time out, then drops it."""
        try:
            await poll.wait(timeout)
        finally:
            with self.lock:
                self.waiters.done(poll)

    def check_serving(self) -> None:
        """A long poll's round: none once the dispatcher stops serving."""
        if self.stopping.is_set():
            raise DpexConnectionError(GOING_AWAY)

    def lose_worker(self, worker_id: str, left: bool = False) -> None:
        """The worker was lost or left: its splits are re-planned, no poll of
        it waits to be answered; the caller holds ``lock``."""
        self.apply(worker_lost=jpb.WorkerLost(worker_id=worker_id, left=left))
        self.seen.lost(worker_id)
        self.waiters.forget_worker(worker_id)

    def job(self, job_id: int) -> Job:
        """The job, or why there is none; the caller holds ``lock``."""
        job = self.state.jobs.get(job_id)
        if job is None and job_id in self.state.collected:
            name = self.state.collected[job_id]
            raise DpexNotFoundError(
                f"job {job_id}{f' ({name!r})' if name else ''} {JOB_COLLECTED}: no call from its trainers "
                f"for --job-gc-timeout {self.config.job_gc_timeout_s:g}s; a new loader makes a fresh job")
        if job is None:
            hint = "" if self.store else " (a dispatcher restarted without --work-dir forgets its jobs)"
            raise DpexNotFoundError(f"unknown job {job_id}{hint}")
        return job

    def claim(self, request: Any, peer: str, job_name: str, takeover: bool = False) -> None:
        """The caller's loader holds the consumer, or a DpexConflictError; the caller holds ``lock``."""
        key = (request.job_id, request.consumer_index)
        busy = (self.state.has_live_plan(*key) and self.seen.consumer_heard_within(*key, HELD_S))
        self.claims.take(key, request.client_id, peer, job_name, busy, takeover)

    def trusted_only(self, peer: str, what: str) -> None:
        """Without a token, every call comes from a loopback peer (code and
        unpickled batches, jobs' names and epochs), unless --allow-unauthenticated."""
        if not answers(peer, self.config.auth_token, self.config.allow_unauthenticated):
            raise self.keys.refusals.refuse(
                "not loopback", peer, f"this dispatcher has no auth token, so it {what} only from loopback "
                "peers; give it a token (--auth-token-file / DPEX_AUTH_TOKEN) or --allow-unauthenticated")

    def job_of(self, request: Any, peer: str, call: str) -> Job:
        """The job ``request`` names, if it carries the job's key (DpexAuthError
        if not; DpexNotFoundError if there is no such job); the caller holds ``lock``."""
        job = self.job(request.job_id)
        self.keys.check_job(request.job_id, request.job_key, peer, call)
        return job

    def describe(self, split: Split, out: dpb.Split) -> None:
        """A split as a worker gets it: its batches, or how to compute them."""
        plan = split.plan
        out.split_id, out.job_id, out.consumer_index, out.epoch = (split.split_id, plan.job_id,
                                                                   plan.consumer_index, plan.epoch)
        out.first_seq, out.num_batches, out.base_seed = split.first_seq, split.num_batches, plan.base_seed
        out.num_streams, out.attempt = plan.num_streams, plan.attempt
        start = plan.stream_starts.get(split.first_seq) if plan.num_streams else None
        if start is not None:
            out.stream_next, out.stream_state, out.stream_replica = start.next, start.state, start.replica
        out.delivered_seqs.extend(sorted(split.delivered))
        if plan.sampler is not None:
            out.sampler.CopyFrom(plan.sampler)
        elif plan.plan_file:
            out.batches.extend(self.plan_files.read(plan.plan_file, split.index, split.num_batches))
        else:
            where = split_seqs(split.first_seq, split.num_batches)
            out.batches.extend(plan.inline[where.start:where.stop])

