"""The two long polls: a worker's heartbeat (answered as soon as it has
splits to take or to drop) and a trainer's sync (answered as soon as the
owners of its plan change). Coroutines on the server's loop: a fleet's long
polls hold no thread; the lock is held between awaits only, never across one."""
from __future__ import annotations

import asyncio
import hashlib
import random
import time

from dpex.dispatcher import assignment
from dpex.dispatcher.journaled import Journaled
from dpex.dispatcher.state import Plan
from dpex.plan import even
from dpex.errors import DpexNotFoundError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


async def heartbeat(core: Journaled, request: dpb.WorkerHeartbeatRequest, peer: str) -> dpb.WorkerHeartbeatResponse:
    """A worker's heartbeat: its load noted, splits chosen for it, and the
    answer given once there is work or something to drop, or at the interval."""
    held = set(request.held_split_ids)
    saturated = frozenset((c.job_id, c.consumer_index) for c in request.saturated)
    with core.lock:
        worker = core.state.workers.get(request.worker_id)
        if worker is None or not worker.alive:
            raise DpexNotFoundError(f"unknown worker {request.worker_id!r}; register again")
        core.keys.check_worker(worker.worker_id, request.worker_key, peer, "WorkerHeartbeat")
        first = worker.worker_id not in core.seen.loads  # since it registered, or since we started
        core.seen.worker(worker.worker_id, request.load)
    # Jittered, so that a fleet that started (or reconnected) at once spreads
    # out instead of polling in bursts of every worker at each interval: a
    # worker's first poll over the whole interval, later ones over its last fifth.
    jitter = random.uniform(0.05, 1.0) if first else random.uniform(0.8, 1.0)
    deadline = time.monotonic() + core.config.heartbeat_interval_s * jitter
    # Every split assigned to the worker that it does not hold yet is sent, so
    # a lost response loses no assignment.
    while True:
        with core.lock:
            core.check_serving()
            if worker.alive:
                chosen = assignment.choose_splits(core.state, worker.worker_id, request.want_splits, saturated)
                if chosen:
                    core.apply(assign_splits=jpb.AssignSplits(worker_id=worker.worker_id, split_ids=chosen))
            release = core.state.releasable(worker.worker_id, list(held))
            settled = core.waiters.settled.get(worker.worker_id, ())
            urgent = [s for s in release if s not in settled]  # cancelled or taken away: free them now
            remaining = deadline - time.monotonic()
            if worker.held - held or urgent or remaining <= 0 or not worker.alive or core.waiters.full:
                pause = remaining > 0 and core.waiters.full  # no room for its poll
                response = dpb.WorkerHeartbeatResponse(
                    release_split_ids=release, pause=pause,
                    forget_job_ids=[job_id for job_id in request.job_ids if job_id not in core.state.jobs])
                for split_id in sorted(worker.held - held):
                    core.describe(core.state.splits[split_id], response.splits.add())
                core.seen.worker(worker.worker_id)
                core.heartbeats += 1
                core.waiters.told(worker.worker_id, held, release)
                return response
            poll = core.waiters.worker(worker.worker_id, request.want_splits > 0)
        await core.wait(poll, remaining)


async def sync(core: Journaled, request: dpb.SyncConsumerRequest, peer: str) -> dpb.SyncConsumerResponse:
    """A trainer's sync: its delivered batches marked, the batch it waits
    for given an owner, and its plan's owners once they change."""
    deadline = time.monotonic() + min(max(request.wait_s, 0.0), 30.0) * random.uniform(0.8, 1.0)  # jittered
    with core.lock:
        job = core.job_of(request, peer, "SyncConsumer")
        core.claim(request, peer, job.definition.name)  # again after a restart of this dispatcher
        plan = core.state.plan(request.job_id, request.consumer_index, request.epoch)
        if plan is None:
            if core.seen.was_released(request.job_id, request.consumer_index):
                raise DpexNotFoundError(
                    f"job {request.job_id} consumer {request.consumer_index} epoch {request.epoch} was released: "
                    f"its trainer had not synced for {core.config.consumer_timeout_s:g}s (the dispatcher's "
                    "--consumer-timeout) and was taken for gone; a trainer stalled that long needs a longer one")
            raise DpexNotFoundError(
                f"job {request.job_id} has no plan for consumer {request.consumer_index} "
                f"epoch {request.epoch} (another trainer may have replaced it)")
        if request.attempt and plan.attempt and request.attempt != plan.attempt:
            # A left iterator's late sync (its last acks, sent as it closed): they are not the plan that
            # replaced it, which has not given those batches. Nothing is marked or asked.
            return dpb.SyncConsumerResponse()
        core.seen.consumer(request.job_id, request.consumer_index, request.workers_needed, request.wait_fraction,
                           request.batches_per_s, request.verdict if request.HasField("verdict") else None,
                           request.waits if request.HasField("waits") else None, request.client_id)
        consumers = job.definition.num_consumers
        if consumers > 1 and core.counts.tell(request.job_id, request.epoch, request.consumer_index, even.Count(
                request.ready, request.total if request.HasField("total") else None)):
            core.waiters.wake_consumers((request.job_id, c) for c in core.counts.gated.get(request.job_id, ()))
        if request.delivered_seqs:
            core.apply(mark_delivered=jpb.MarkDelivered(
                job_id=request.job_id, consumer_index=request.consumer_index,
                epoch=request.epoch, seqs=request.delivered_seqs))
        # The batch the consumer waits for must have an owner now, even if
        # every worker is full (of batches the consumer cannot take before it).
        waited = assignment.owner_for(core.state, plan, request.next_seq)
        if waited is not None:
            core.apply(assign_splits=jpb.AssignSplits(worker_id=waited[0], split_ids=[waited[1]]))
    try:
        return await _owners(core, request, plan, deadline, consumers)
    except asyncio.CancelledError:
        # The trainer's connection ended (a dead process, when the server sees it; else its
        # silence frees the consumer after claims.HELD_S), or its loader left the poll: it
        # claims its consumer again with its next call, if it has one.
        with core.lock:
            core.claims.gone((request.job_id, request.consumer_index), request.client_id)
        raise


async def _owners(core: Journaled, request: dpb.SyncConsumerRequest, plan: Plan,
                  deadline: float, consumers: int) -> dpb.SyncConsumerResponse:
    """The plan's owners, once they differ from those the trainer knows; with a
    ``gate`` (even_batches), once the consumers' counts decide that batch; asked
    by another consumer's gate to tell its count again, at once."""
    me = (request.job_id, request.consumer_index)
    gated = request.HasField("gate") and request.even_batches
    while True:
        with core.lock:
            core.check_serving()
            owners = core.state.owners(plan)
            digest = hashlib.sha256(repr([(s.split_id, w.worker_id) for s, w in owners]).encode()).digest()[:16]
            remaining = deadline - time.monotonic()
            counts = core.counts.of(request.job_id, request.epoch) if consumers > 1 else {}
            decided = gated and even.decide(request.even_batches, request.gate, counts, consumers) is not None
            if gated and not decided:  # those whose word may decide it are asked to tell it again
                for c in even.waited_on(request.gate, counts, consumers):
                    if c != request.consumer_index and core.counts.ask(request.job_id, c, request.gate):
                        core.waiters.wake_consumers([(request.job_id, c)])
            asked = core.counts.asked(*me)
            if (digest != request.owners_digest or remaining <= 0 or core.waiters.full or decided
                    or (not gated and asked is not None and not asked[1])):
                response = dpb.SyncConsumerResponse(workers_alive=len(core.state.alive_workers()),
                                                    owners_digest=digest)
                for split, worker in owners:
                    response.owners.add(split_id=split.split_id, first_seq=split.first_seq,
                                        num_batches=split.num_batches, worker_id=worker.worker_id,
                                        worker_address=worker.address)
                for c, count in sorted(counts.items()):
                    response.counts.add(consumer_index=c, ready=count.ready, total=count.total)
                if asked is not None:
                    response.report_past = asked[0]
                    core.counts.told(*me)
                return response
            poll = core.waiters.consumer(me)
            if gated:
                core.counts.gate(*me, waiting=True)
        try:
            await core.wait(poll, remaining)
        finally:
            if gated:
                with core.lock:
                    core.counts.gate(*me, waiting=False)
