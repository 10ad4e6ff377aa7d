"""The dispatcher without gRPC: validates requests, turns them into updates,
journals and applies them to the pure state machine under one lock, and
answers the workers' and trainers' long polls. Protos in, protos out,
DpexErrors raised; ``peer`` is the caller's address as gRPC names it
(``ipv4:127.0.0.1:5555``). dpex.dispatcher.service is the gRPC table in
front of it, as tf.data service's grpc_dispatcher_impl is before
dispatcher_impl. No data plane work here."""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import secrets
import threading
import time
from typing import Callable


from dpex.config import DispatcherConfig
from dpex.dispatcher.store import Store
from dpex.dispatcher.claims import HELD_S, Claims
from dpex.dispatcher.liveness import Liveness, unreachable
from dpex.dispatcher.planfiles import PlanFiles
from dpex.dispatcher.state import DispatcherState, Plan
from dpex.dispatcher.waiters import Waiters
from dpex.auth import is_loopback_peer
from dpex.log import fields
from dpex.plan import samplers
from dpex.plan.seq import split_seqs
from dpex.plan.spec import PlanHash, of_loader, resumed
from dpex.procutil import temp_dir
from dpex.errors import (GOING_AWAY, JOB_COLLECTED, DpexAuthError, DpexConfigError, DpexConflictError,
                         DpexConnectionError, DpexNotFoundError)
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")


# JobDef fields by the loader argument that sets them.
_ARGUMENT = {"collate": "collate_fn", "process_seeds": "reproducible", "main_process": "num_workers",
             "out_of_order": "in_order"}
_CODE = {"dataset", "collate", "worker_init_fn"}  # pickled code


def differing_fields(a: dpb.JobDef, b: dpb.JobDef, settings_only: bool = False) -> list[str]:
    """The loader arguments on which two definitions of a job differ (with
    ``settings_only``, not counting the pickled code)."""
    return [_ARGUMENT.get(f.name, f.name) for f in dpb.JobDef.DESCRIPTOR.fields
            if f.name != "name" and not (settings_only and f.name in _CODE)
            and getattr(a, f.name) != getattr(b, f.name)]


class DispatcherCore:
    def __init__(self, config: DispatcherConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: what the liveness tables (heartbeat, consumer and GC
        timeouts) read; the long polls wait in real time."""
        self._config = config
        self._state = DispatcherState()
        self._lock = threading.RLock()
        self._waiters = Waiters()
        self._seen = Liveness(clock)
        self._claims = Claims()  # which loader holds each consumer
        self._started = time.monotonic()
        self._heartbeats = 0  # answered since start (the GetStatus counter)
        # Splits a worker holds that were delivered in full: it drops them with its
        # next heartbeat's answer; they do not make a waiting heartbeat answer early.
        self._settled: dict[str, set[int]] = {}
        self._store = Store(config.work_dir, config.journal_compact_bytes) if config.work_dir else None
        self._own_plan_dir = None if config.work_dir else temp_dir("dispatcher")
        self._plan_files = PlanFiles(os.path.join(config.work_dir, "plans") if config.work_dir
                                     else self._own_plan_dir)
        if self._store is not None:
            started = time.monotonic()
            self._state = self._store.recover()
            # Recovered workers get a whole timeout to heartbeat again.
            for w in self._state.workers.values():
                self._seen.worker(w.worker_id) if w.alive else self._seen.lost(w.worker_id)
            for job in self._state.jobs.values():
                self._seen.job(job.job_id)
                for c in job.plans:
                    self._seen.consumer(job.job_id, c)
            log.info("recovered from %s (snapshot generation %d + %d log records) in %.2fs: %d workers, %d jobs",
                     config.work_dir, self._store.generation, self._store.replayed, time.monotonic() - started,
                     len(self._state.alive_workers()), len(self._state.jobs))
        self._stop = threading.Event()
        self._closed = False  # the journal is closed: no update is taken any more
        self._reaper = threading.Thread(target=self._reap, name="dpex-reaper", daemon=True)
        self._reaper.start()

    def stop_serving(self) -> None:
        """The first step of a graceful stop: the long polls end now with
        UNAVAILABLE, which clients read as an outage of the dispatcher (they
        retry until it is back); the server stops taking calls next."""
        self._stop.set()
        with self._lock:
            self._waiters.wake_all()

    def close(self) -> None:
        """Stops the reaper and closes the journal (after the server stopped:
        an update that still comes is refused as the dispatcher going away)."""
        self.stop_serving()
        if self._reaper.is_alive() and self._reaper is not threading.current_thread():
            self._reaper.join()
        with self._lock:
            self._closed = True
            if self._store is not None:
                self._store.close()
        self._plan_files.close()
        if self._own_plan_dir is not None:
            import shutil
            shutil.rmtree(self._own_plan_dir, ignore_errors=True)

    def _apply(self, **kind) -> object:
        """Journals one update, then applies it; the caller holds self._lock."""
        if self._closed:
            raise DpexConnectionError(GOING_AWAY)
        update = jpb.Update(**kind)
        if self._store is not None:
            self._store.append(update)  # written before it takes effect; durable before any answer
        result = self._state.apply(update)
        changes = self._state.take_changes()
        for worker_id, split_ids in changes.settled.items():
            self._settled.setdefault(worker_id, set()).update(split_ids)
        if self._store is not None and self._store.due(changes.plans_ended > 0):
            self._store.compact(self._state)  # the log restarts from a snapshot of the live state
        self._waiters.wake(changes)
        return result

    async def _wait(self, poll, timeout: float) -> None:
        """Waits (the lock not held) for a long poll to be woken or time out, then drops it."""
        try:
            await poll.wait(timeout)
        finally:
            with self._lock:
                self._waiters.done(poll)

    def _worker_gone(self, worker_id: str) -> None:
        """A worker was lost or left (its splits re-planned): no poll of it to answer."""
        self._seen.lost(worker_id)
        self._settled.pop(worker_id, None)

    @property
    def store(self) -> Store | None:
        """The journal (None without a work dir): what an answer waits to be durable in."""
        return self._store

    def _reap(self) -> None:
        period = min(self._config.heartbeat_interval_s, self._config.heartbeat_timeout_s / 4, 1.0)
        while not self._stop.wait(period):
            self.reap()

    def reap(self) -> None:
        """One round of the reaper (a thread runs it every second or so):
        marks silent workers lost, releases silent consumers, collects garbage."""
        with self._lock:
            alive = [w.worker_id for w in self._state.alive_workers()]
            for worker_id in self._seen.silent_workers(alive, self._config.heartbeat_timeout_s):
                worker = self._state.workers[worker_id]
                log.warning("worker missed its heartbeat timeout (%.1fs); marking it lost",
                            self._config.heartbeat_timeout_s,
                            extra=fields(worker_id=worker.worker_id, address=worker.address,
                                         splits_replanned=len(worker.held)))
                self._apply(worker_lost=jpb.WorkerLost(worker_id=worker.worker_id))
                self._worker_gone(worker.worker_id)
            for job_id, consumer in self._seen.silent_consumers(self._config.consumer_timeout_s):
                if self._state.has_live_plan(job_id, consumer):
                    log.warning("consumer has not synced for %.0fs; releasing its plan (its "
                                "workers drop what they hold for it)", self._config.consumer_timeout_s,
                                extra=fields(job_id=job_id, consumer=consumer))
                    self._apply(release_consumer=jpb.ReleaseConsumer(job_id=job_id,
                                                                     consumer_index=consumer, closed=True))
            self._collect()
            self._plan_files.keep({p.plan_file for j in self._state.jobs.values()
                                   for p in j.plans.values() if p.plan_file and not p.finished})

    def _collect(self) -> None:
        """Garbage collection; the caller holds self._lock."""
        config = self._config
        if config.worker_gc_timeout_s:
            for worker_id in self._seen.lost_for(config.worker_gc_timeout_s):
                log.info("forgetting a worker gone for %.0fs", config.worker_gc_timeout_s,
                         extra=fields(worker_id=worker_id))
                self._apply(forget_worker=jpb.ForgetWorker(worker_id=worker_id))
                self._seen.forget_worker(worker_id)
        if config.job_gc_timeout_s:
            idle = [j for j in self._state.jobs if self._state.job_state(j) != "running"]
            for job_id in self._seen.idle_jobs(idle, config.job_gc_timeout_s):
                log.info("removing a job without consumers for %.0fs", config.job_gc_timeout_s,
                         extra=fields(job_id=job_id, job_name=self._state.jobs[job_id].definition.name))
                self._apply(remove_job=jpb.RemoveJob(job_id=job_id))
                self._seen.forget_job(job_id)
                self._claims.forget_job(job_id)

    def _describe(self, split, out: dpb.Split) -> None:
        """A split as a worker gets it: its batches, or how to compute them."""
        plan = split.plan
        out.split_id, out.job_id, out.consumer_index, out.epoch = (split.split_id, plan.job_id,
                                                                   plan.consumer_index, plan.epoch)
        out.first_seq, out.num_batches, out.base_seed = split.first_seq, split.num_batches, plan.base_seed
        out.num_streams = plan.num_streams
        start = plan.stream_starts.get(split.first_seq) if plan.num_streams else None
        if start is not None:
            out.stream_next, out.stream_state, out.stream_replica = start.next, start.state, start.replica
        out.delivered_seqs.extend(sorted(split.delivered))
        if plan.sampler is not None:
            out.sampler.CopyFrom(plan.sampler)
        elif plan.plan_file:
            out.batches.extend(self._plan_files.read(plan.plan_file, split.index, split.num_batches))
        else:
            where = split_seqs(split.first_seq, split.num_batches)
            out.batches.extend(plan.inline[where.start:where.stop])

    # ---- workers ----------------------------------------------------------
    def register_worker(self, request, peer: str):
        self._trusted_only(peer, "registers workers (whose batches trainers unpickle)")
        if not request.address or ":" not in request.address:
            raise DpexConfigError(f"worker address must be HOST:PORT, got {request.address!r}")
        worker_id = "w-" + secrets.token_hex(4)
        with self._lock:
            self._apply(register_worker=jpb.RegisterWorker(worker_id=worker_id, address=request.address))
            self._seen.worker(worker_id)
            self._seen.keep_workers(self._state.workers)  # one replaced on this address is gone
        log.info("worker registered", extra=fields(worker_id=worker_id, address=request.address))
        return dpb.RegisterWorkerResponse(worker_id=worker_id)

    async def worker_heartbeat(self, request, peer: str):
        # A coroutine on the server's loop: a fleet's long polls hold no thread.
        # The lock is held between awaits only, never across one.
        held = set(request.held_split_ids)
        saturated = frozenset((c.job_id, c.consumer_index) for c in request.saturated)
        with self._lock:
            worker = self._state.workers.get(request.worker_id)
            if worker is None or not worker.alive:
                raise DpexNotFoundError(f"unknown worker {request.worker_id!r}; register again")
            first = worker.worker_id not in self._seen.loads  # since it registered, or since we started
            self._seen.worker(worker.worker_id, request.load)
        # Jittered, so that a fleet that started (or reconnected) at once spreads
        # out instead of polling in bursts of every worker at each interval: a
        # worker's first poll over the whole interval, later ones over its last fifth.
        jitter = random.uniform(0.05, 1.0) if first else random.uniform(0.8, 1.0)
        deadline = time.monotonic() + self._config.heartbeat_interval_s * jitter
        # Long-poll: answer as soon as there is work, so a plan starts within
        # milliseconds, or splits to drop (a trainer left its epoch: the worker
        # frees what it holds for it now). Every split assigned to the worker
        # that it does not hold yet is sent, so a lost response loses no assignment.
        while True:
            with self._lock:
                if self._stop.is_set():
                    raise DpexConnectionError(GOING_AWAY)
                if worker.alive:
                    chosen = self._state.choose_splits(worker.worker_id, request.want_splits, saturated)
                    if chosen:
                        self._apply(assign_splits=jpb.AssignSplits(worker_id=worker.worker_id,
                                                                   split_ids=chosen))
                release = self._state.releasable(worker.worker_id, list(held))
                settled = self._settled.get(worker.worker_id, set())
                settled &= held  # what it no longer holds needs no word
                urgent = [s for s in release if s not in settled]  # cancelled or taken away: free them now
                remaining = deadline - time.monotonic()
                if worker.held - held or urgent or remaining <= 0 or not worker.alive or self._waiters.full:
                    pause = remaining > 0 and self._waiters.full  # no room for its poll
                    response = dpb.WorkerHeartbeatResponse(release_split_ids=release, pause=pause)
                    for split_id in sorted(worker.held - held):
                        self._describe(self._state.splits[split_id], response.splits.add())
                    self._seen.worker(worker.worker_id)
                    self._heartbeats += 1
                    if worker.worker_id in self._settled:
                        settled -= set(release)
                        if not settled:
                            del self._settled[worker.worker_id]
                    return response
                poll = self._waiters.worker(worker.worker_id, request.want_splits > 0)
            await self._wait(poll, remaining)

    def deregister_worker(self, request, peer: str):
        with self._lock:
            worker = self._state.workers.get(request.worker_id)
            if worker is not None and worker.alive:
                log.info("worker is leaving; re-planning its splits",
                         extra=fields(worker_id=worker.worker_id, address=worker.address,
                                      splits_replanned=len(worker.held)))
                self._apply(worker_lost=jpb.WorkerLost(worker_id=worker.worker_id, left=True))
                self._worker_gone(worker.worker_id)
        return dpb.DeregisterWorkerResponse()

    def report_worker(self, request, peer: str):
        with self._lock:
            reported = [w.worker_id for w in self._state.alive_workers() if w.address == request.address]
        if not reported:
            return dpb.ReportWorkerResponse(lost=False)
        why = unreachable(request.address)  # the lock is not held across the probe
        if why is None:  # a healthy worker whose stream broke for another reason stays
            log.info("a trainer's stream to a worker broke, but the worker accepts connections; keeping it",
                     extra=fields(address=request.address, trainer=peer, error=request.error))
            return dpb.ReportWorkerResponse(lost=False)
        lost = False
        with self._lock:
            for worker_id in reported:
                worker = self._state.workers.get(worker_id)
                if worker is not None and worker.alive:
                    log.warning("worker is gone (a trainer's stream to it broke and its port refuses "
                                "connections: %s); marking it lost", why,
                                extra=fields(worker_id=worker_id, address=worker.address,
                                             splits_replanned=len(worker.held), trainer=peer))
                    self._apply(worker_lost=jpb.WorkerLost(worker_id=worker_id))
                    self._worker_gone(worker_id)
                    lost = True
        return dpb.ReportWorkerResponse(lost=lost)

    def _trusted_only(self, peer: str, what: str) -> None:
        """Without a token, code and unpickled batches come only from loopback peers."""
        if not (self._config.auth_token or self._config.allow_unauthenticated
                or is_loopback_peer(peer)):
            raise DpexAuthError(
                f"this dispatcher has no auth token, so it {what} only from loopback peers; give it a token "
                "(--auth-token-file / DPEX_AUTH_TOKEN) or --allow-unauthenticated")

    # ---- jobs and plans -----------------------------------------------------
    def get_or_create_job(self, request, peer: str):
        self._trusted_only(peer, "takes jobs (which carry code for the workers)")
        job = request.job
        if job.num_consumers < 1:
            raise DpexConfigError("num_consumers must be >= 1")
        if not job.dataset:
            raise DpexConfigError("the job has no dataset")
        with self._lock:
            existing = self._state.find_job(job.name) if job.name else None
            if existing is not None:
                differ = differing_fields(existing.definition, job, request.settings_only)
                if differ:
                    hint = ("" if not _CODE & set(differ) else
                            " (a dataset or function pickled by value - a class or function defined in "
                            "__main__ - pickles differently in each process: name it with "
                            "DatasetSpec('module:attr') to share a job across processes)")
                    values = "; ".join(f"{name}={getattr(job, name)!r} here, {getattr(existing.definition, name)!r} "
                                       "in the job" for name in differ if name in dpb.JobDef.DESCRIPTOR.fields_by_name
                                       and name not in _CODE)
                    raise DpexConflictError(
                        f"job {job.name!r} already exists with a different {', '.join(differ)}"
                        f"{f' ({values})' if values else ''}; use another job_name or the same arguments{hint}")
                self._seen.job(existing.job_id)
                return dpb.GetOrCreateJobResponse(job_id=existing.job_id, created=False)
            job_id = secrets.randbits(63)
            self._apply(create_job=jpb.CreateJob(job_id=job_id, job=job))
            self._seen.job(job_id)
        log.info("job created", extra=fields(job_id=job_id, job_name=job.name,
                                             consumers=job.num_consumers, peer=peer))
        return dpb.GetOrCreateJobResponse(job_id=job_id, created=True)

    def _job(self, job_id: int):
        job = self._state.jobs.get(job_id)
        if job is None and job_id in self._state.collected:
            name = self._state.collected[job_id]
            raise DpexNotFoundError(
                f"job {job_id}{f' ({name!r})' if name else ''} {JOB_COLLECTED}: no call from its trainers "
                f"for --job-gc-timeout {self._config.job_gc_timeout_s:g}s; a new loader makes a fresh job")
        if job is None:
            hint = "" if self._store else " (a dispatcher restarted without --work-dir forgets its jobs)"
            raise DpexNotFoundError(f"unknown job {job_id}{hint}")
        return job

    def get_job(self, request, peer: str):
        with self._lock:
            return dpb.GetJobResponse(job=self._job(request.job_id).definition)

    def submit_plan(self, request, peer: str):
        if sum(map(bool, (request.num_streams, request.batches or request.upload_id,
                          request.HasField("sampler")))) > 1:
            raise DpexConfigError("a plan has one of batches, a sampler or streams")
        meta = (request.job_id, request.consumer_index, request.epoch, request.base_seed)
        plan_file, sampler = "", None
        if request.HasField("sampler"):
            sampler = request.sampler
            samplers.validate(sampler)
            num_batches = samplers.num_batches(sampler)
            digest = PlanHash(request.base_seed, 0, sampler).digest()
        elif request.num_streams:
            num_batches, digest = 0, PlanHash(request.base_seed, request.num_streams).digest()
        else:  # explicit batches: on disk, chunk by chunk
            with self._lock:
                self._job(request.job_id)
            upload_id = request.upload_id or secrets.randbits(63) + 1
            upload = self._plan_files.add(upload_id, request.chunk, request.batches,
                                          self._config.split_size_batches, meta)
            if upload.num_batches > self._config.max_plan_batches:
                raise DpexConfigError(f"a plan of more than {self._config.max_plan_batches} batches is over "
                                      "this dispatcher's limit (--max-plan-batches)")
            if request.more:
                return dpb.SubmitPlanResponse(num_batches=upload.num_batches)
            plan_file, num_batches, digest = self._plan_files.finish(upload_id)
        digest = of_loader(resumed(digest, request.done, request.resume_id), request.client_id)
        if num_batches > self._config.max_plan_batches:
            raise DpexConfigError(f"a plan of {num_batches} batches is over this dispatcher's "
                                  f"limit of {self._config.max_plan_batches} (--max-plan-batches)")
        with self._lock:
            job = self._job(request.job_id)
            if request.consumer_index >= job.definition.num_consumers:
                raise DpexConfigError(f"consumer_index {request.consumer_index} is out of range for "
                                      f"a job with {job.definition.num_consumers} consumers")
            for other, other_plan in job.plans.items():
                if (other != request.consumer_index and other_plan.epoch == request.epoch
                        and other_plan.num_batches != num_batches and not request.num_streams):
                    raise DpexConfigError(
                        f"consumer {request.consumer_index} planned {num_batches} batches for "
                        f"epoch {request.epoch} but consumer {other} planned {other_plan.num_batches}; "
                        "every consumer must get the same number of batches (DDP ranks would hang)")
            self._claim(request, peer, job.definition.name, takeover=bool(request.resume_id))
            self._seen.consumer(request.job_id, request.consumer_index)
            same = self._state.plan(request.job_id, request.consumer_index, request.epoch)
            if same is not None and same.plan_hash == digest:  # a reconnect: nothing changes
                return dpb.SubmitPlanResponse(num_batches=same.num_batches, num_delivered=same.num_delivered)
            plan: Plan = self._apply(submit_plan=jpb.SubmitPlan(
                job_id=request.job_id, consumer_index=request.consumer_index, epoch=request.epoch,
                plan_hash=digest, split_size=self._config.split_size_batches, base_seed=request.base_seed,
                num_streams=request.num_streams, sampler=sampler, plan_file=plan_file, num_batches=num_batches,
                done=request.done, stream_starts=request.stream_starts))
            log.info("plan submitted", extra=fields(job_id=request.job_id, consumer=request.consumer_index,
                                                    epoch=request.epoch, batches=plan.num_batches,
                                                    splits=plan.num_splits,
                                                    kind="sampler" if sampler else "file" if plan_file else "streams"))
            return dpb.SubmitPlanResponse(num_batches=plan.num_batches, num_delivered=plan.num_delivered)

    async def sync_consumer(self, request, peer: str):
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), 30.0) * random.uniform(0.8, 1.0)  # jittered
        with self._lock:
            job = self._job(request.job_id)
            self._claim(request, peer, job.definition.name)  # again after a restart of this dispatcher
            plan = self._state.plan(request.job_id, request.consumer_index, request.epoch)
            if plan is None:
                raise DpexNotFoundError(
                    f"job {request.job_id} has no plan for consumer {request.consumer_index} "
                    f"epoch {request.epoch} (another trainer may have replaced it)")
            self._seen.consumer(request.job_id, request.consumer_index, request.workers_needed)
            if request.delivered_seqs:
                self._apply(mark_delivered=jpb.MarkDelivered(
                    job_id=request.job_id, consumer_index=request.consumer_index,
                    epoch=request.epoch, seqs=request.delivered_seqs))
            # The batch the consumer waits for must have an owner now, even if
            # every worker is full (of batches the consumer cannot take before it).
            waited = self._state.unassigned_split_of(plan, request.next_seq)
            target = self._state.least_loaded_worker() if waited is not None else None
            if target is not None:
                self._apply(assign_splits=jpb.AssignSplits(worker_id=target.worker_id, split_ids=[waited]))
        # Long-poll until the owners change, so the trainer learns of a new
        # assignment at once without polling.
        try:
            return await self._sync_poll(request, plan, deadline)
        except asyncio.CancelledError:
            # The trainer's connection ended (a dead process, when the server sees it; else its
            # silence frees the consumer after claims.HELD_S), or its loader left the poll: it
            # claims its consumer again with its next call, if it has one.
            with self._lock:
                self._claims.gone((request.job_id, request.consumer_index), request.client_id)
            raise

    async def _sync_poll(self, request, plan, deadline: float) -> dpb.SyncConsumerResponse:
        while True:
            with self._lock:
                if self._stop.is_set():
                    raise DpexConnectionError(GOING_AWAY)
                owners = self._state.owners(plan)
                digest = hashlib.sha256(repr([(s.split_id, w.worker_id) for s, w in owners])
                                        .encode()).digest()[:16]
                remaining = deadline - time.monotonic()
                if digest != request.owners_digest or remaining <= 0 or self._waiters.full:
                    response = dpb.SyncConsumerResponse(workers_alive=len(self._state.alive_workers()),
                                                        owners_digest=digest)
                    for split, worker in owners:
                        response.owners.add(split_id=split.split_id, first_seq=split.first_seq,
                                            num_batches=split.num_batches, worker_id=worker.worker_id,
                                            worker_address=worker.address)
                    return response
                poll = self._waiters.consumer((request.job_id, request.consumer_index))
            await self._wait(poll, remaining)

    def _claim(self, request, peer: str, job_name: str, takeover: bool = False) -> None:
        """The caller's loader holds the consumer, or a DpexConflictError (the caller holds self._lock)."""
        key = (request.job_id, request.consumer_index)
        busy = (self._state.has_live_plan(*key) and self._seen.consumer_heard_within(*key, HELD_S))
        self._claims.take(key, request.client_id, peer, job_name, busy, takeover)

    def release_consumer(self, request, peer: str):
        with self._lock:
            key = (request.job_id, request.consumer_index)
            if not self._claims.holds(key, request.client_id):  # another loader's: not this one's to end
                return dpb.ReleaseConsumerResponse()
            if not request.HasField("epoch"):
                self._claims.release(key, request.client_id)
            closed = not request.HasField("epoch")  # no epoch: the loader is closing
            plan = self._state.plan(request.job_id, request.consumer_index,
                                    None if closed else request.epoch)
            job = self._state.jobs.get(request.job_id)
            if plan is None and not (closed and job is not None and request.consumer_index in job.epochs):
                return dpb.ReleaseConsumerResponse()  # nothing, or a newer epoch: keep it
            self._seen.forget_consumer(request.job_id, request.consumer_index)
            release = jpb.ReleaseConsumer(job_id=request.job_id, consumer_index=request.consumer_index,
                                          closed=closed)
            if plan is not None:
                release.epoch = plan.epoch
            self._apply(release_consumer=release)
        return dpb.ReleaseConsumerResponse()

    def status(self) -> dpb.GetStatusResponse:
        """Workers, jobs and counters, for `dpex status` and the metrics endpoint."""
        now = time.monotonic()
        state = self._state
        with self._lock:
            response = dpb.GetStatusResponse(splits_assigned_total=state.splits_assigned_total,
                                             splits_reassigned_total=state.splits_reassigned_total,
                                             uptime_s=now - self._started,
                                             jobs_collected_total=state.jobs_collected_total,
                                             workers_forgotten_total=state.workers_forgotten_total,
                                             worker_heartbeats_total=self._heartbeats)
            for w in state.workers.values():
                response.workers.add(worker_id=w.worker_id, address=w.address,
                                     state="alive" if w.alive else "left" if w.left else "lost",
                                     splits_held=len(w.held),
                                     seconds_since_heartbeat=self._seen.since_heartbeat(w.worker_id),
                                     load=self._seen.loads.get(w.worker_id) if w.alive else None)
            assigned = {job_id: 0 for job_id in state.jobs}
            for split in state.splits.values():
                if split.worker_id is not None and split.job_id in assigned:
                    assigned[split.job_id] += 1
            for job in state.jobs.values():
                plans = job.plans
                response.jobs.add(job_id=job.job_id, name=job.definition.name,
                                  num_consumers=job.definition.num_consumers,
                                  batches_planned=job.batches_planned,
                                  batches_delivered=job.batches_delivered,
                                  splits_unassigned=state.unassigned(job.job_id),
                                  splits_assigned=assigned[job.job_id],
                                  consumers_active=sum(state.has_live_plan(job.job_id, c) for c in plans),
                                  epochs=[job.epochs[c] for c in sorted(job.epochs)],
                                  state=state.job_state(job.job_id),
                                  workers_needed=self._seen.workers_needed(job.job_id))
        alive = sum(w.state == "alive" for w in response.workers)
        extra = [max(0, j.workers_needed - alive) for j in response.jobs if j.workers_needed]
        response.workers_needed = alive + sum(extra) if extra else 0
        return response
