"""The dispatcher's state, as a pure state machine.

Every change is one ``Update`` record (journal.proto) passed to
:meth:`DispatcherState.apply`, which does no I/O, reads no clock and takes no
lock. The service validates a request, builds the update and applies it under
its own lock, so that replaying the same updates rebuilds the same state (ids
the state allocates, like split ids, are deterministic).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


_REMEMBER_COLLECTED = 10_000  # collected job ids kept, to tell a returning trainer what happened


@dataclass
class Worker:
    worker_id: str
    address: str
    alive: bool = True
    left: bool = False  # deregistered (drained), not lost
    held: set[int] = field(default_factory=set)  # assigned splits not yet delivered


@dataclass
class Split:
    split_id: int
    job_id: int
    consumer_index: int
    epoch: int
    first_seq: int
    batches: list[dpb.IndexBatch]
    base_seed: int = 0
    num_streams: int = 0  # > 0: the stream first_seq of an IterableDataset epoch
    worker_id: str | None = None
    delivered: set[int] = field(default_factory=set)  # seqs

    @property
    def key(self) -> tuple[int, int, int]:
        # Lowest first: consumers of one job advance side by side (DDP ranks
        # run in lockstep, so a worker must not fill up with one rank's splits).
        return (self.epoch, self.first_seq, self.consumer_index)


@dataclass
class Plan:
    epoch: int
    plan_hash: bytes
    split_size: int
    num_batches: int
    split_ids: list[int]
    num_delivered: int = 0
    num_streams: int = 0  # > 0: one split per stream, lengths unknown


@dataclass
class Job:
    job_id: int
    definition: dpb.JobDef
    plans: dict[int, Plan] = field(default_factory=dict)  # consumer -> newest plan
    epochs: dict[int, int] = field(default_factory=dict)  # consumer -> newest epoch it planned
    closed: set[int] = field(default_factory=set)         # consumers gone (closed or silent)
    batches_planned: int = 0
    batches_delivered: int = 0


class DispatcherState:
    """All dispatcher state; mutate it only through :meth:`apply`."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self.jobs: dict[int, Job] = {}
        self.jobs_by_name: dict[str, int] = {}
        self.splits: dict[int, Split] = {}          # live: not delivered, not cancelled
        self.unassigned: dict[int, set[int]] = {}   # job id -> split ids
        self.next_split_id = 1
        self.splits_assigned_total = 0    # counters for metrics; replay rebuilds them too
        self.splits_reassigned_total = 0
        self.jobs_collected_total = 0
        self.workers_forgotten_total = 0
        self.collected: OrderedDict[int, str] = OrderedDict()  # recently collected job ids -> names

    # ---- the one entry point for changes ---------------------------------
    def apply(self, update: jpb.Update) -> Any:
        kind = update.WhichOneof("kind")
        handler = getattr(self, f"_apply_{kind}", None)
        if handler is None:
            raise ValueError(f"unknown update kind {kind!r}")
        return handler(getattr(update, kind))

    def _apply_register_worker(self, u: jpb.RegisterWorker) -> None:
        for old in list(self.workers.values()):
            if old.address == u.address:  # a restart on the same address replaces it
                self._lose(old)
                del self.workers[old.worker_id]
        self.workers[u.worker_id] = Worker(u.worker_id, u.address)

    def _apply_worker_lost(self, u: jpb.WorkerLost) -> None:
        worker = self.workers.get(u.worker_id)
        if worker is not None:
            self._lose(worker)
            worker.left = u.left

    def _apply_forget_worker(self, u: jpb.ForgetWorker) -> None:
        worker = self.workers.get(u.worker_id)
        if worker is not None and not worker.alive:
            del self.workers[u.worker_id]
            self.workers_forgotten_total += 1

    def _apply_remove_job(self, u: jpb.RemoveJob) -> None:
        job = self.jobs.pop(u.job_id, None)
        if job is None:
            return
        for plan in job.plans.values():
            self._cancel(plan)  # its workers are told to drop the splits at their next heartbeat
        if self.jobs_by_name.get(job.definition.name) == u.job_id:
            del self.jobs_by_name[job.definition.name]
        self.unassigned.pop(u.job_id, None)
        self.jobs_collected_total += 1
        self.collected[u.job_id] = job.definition.name
        while len(self.collected) > _REMEMBER_COLLECTED:
            self.collected.popitem(last=False)

    def _apply_create_job(self, u: jpb.CreateJob) -> None:
        definition = dpb.JobDef()
        definition.CopyFrom(u.job)
        self.jobs[u.job_id] = Job(u.job_id, definition)
        if u.job.name:
            self.jobs_by_name[u.job.name] = u.job_id
        self.unassigned[u.job_id] = set()

    def _apply_submit_plan(self, u: jpb.SubmitPlan) -> Plan:
        job = self.jobs[u.job_id]
        old = job.plans.get(u.consumer_index)
        if old is not None and old.epoch == u.epoch and old.plan_hash == u.plan_hash:
            return old  # the same plan again: a reconnect, keep the progress
        if old is not None:
            self._cancel(old)
        size = max(1, u.split_size)
        plan = Plan(u.epoch, u.plan_hash, size, len(u.batches), [], num_streams=u.num_streams)
        for stream in range(u.num_streams):
            split = Split(self.next_split_id, u.job_id, u.consumer_index, u.epoch, stream, [],
                          u.base_seed, num_streams=u.num_streams)
            self.next_split_id += 1
            self.splits[split.split_id] = split
            self.unassigned[u.job_id].add(split.split_id)
            plan.split_ids.append(split.split_id)
        for first in range(0, len(u.batches), size):
            split = Split(self.next_split_id, u.job_id, u.consumer_index, u.epoch, first,
                          list(u.batches[first:first + size]), u.base_seed)
            self.next_split_id += 1
            self.splits[split.split_id] = split
            self.unassigned[u.job_id].add(split.split_id)
            plan.split_ids.append(split.split_id)
        job.plans[u.consumer_index] = plan
        job.epochs[u.consumer_index] = u.epoch
        job.closed.discard(u.consumer_index)
        job.batches_planned += plan.num_batches
        return plan

    def _apply_assign_splits(self, u: jpb.AssignSplits) -> list[int]:
        worker = self.workers.get(u.worker_id)
        if worker is None or not worker.alive:
            return []
        assigned = []
        for split_id in u.split_ids:
            split = self.splits.get(split_id)
            if split is not None and split.worker_id is None:
                self._assign(split, worker)
                assigned.append(split_id)
        return assigned

    def _apply_mark_delivered(self, u: jpb.MarkDelivered) -> int:
        job = self.jobs[u.job_id]
        plan = job.plans.get(u.consumer_index)
        if plan is None or plan.epoch != u.epoch:
            return 0
        if plan.num_streams:  # stream lengths are unknown: count only
            plan.num_delivered += len(u.seqs)
            job.batches_delivered += len(u.seqs)
            return len(u.seqs)
        newly = 0
        for seq in u.seqs:
            if seq >= plan.num_batches:
                continue
            split = self.splits.get(plan.split_ids[seq // plan.split_size])
            if split is None or seq in split.delivered:
                continue
            split.delivered.add(seq)
            newly += 1
            if len(split.delivered) == len(split.batches):
                self._drop(split)
        plan.num_delivered += newly
        job.batches_delivered += newly
        return newly

    def _apply_release_consumer(self, u: jpb.ReleaseConsumer) -> None:
        if u.closed and u.job_id in self.jobs:
            self.jobs[u.job_id].closed.add(u.consumer_index)
        plan = self.plan(u.job_id, u.consumer_index, u.epoch if u.HasField("epoch") else None)
        if plan is None:
            return  # with an epoch: a newer plan of the consumer's is not touched
        del self.jobs[u.job_id].plans[u.consumer_index]
        self._cancel(plan)

    # ---- helpers (called only from apply) ----------------------------------
    def _assign(self, split: Split, worker: Worker) -> None:
        self.unassigned[split.job_id].discard(split.split_id)
        split.worker_id = worker.worker_id
        worker.held.add(split.split_id)
        self.splits_assigned_total += 1

    def _lose(self, worker: Worker) -> None:
        worker.alive = False
        for split_id in worker.held:
            split = self.splits[split_id]
            split.worker_id = None
            self.unassigned[split.job_id].add(split_id)
        self.splits_reassigned_total += len(worker.held)
        worker.held.clear()

    def _drop(self, split: Split) -> None:
        del self.splits[split.split_id]
        self.unassigned[split.job_id].discard(split.split_id)
        if split.worker_id is not None and split.worker_id in self.workers:
            self.workers[split.worker_id].held.discard(split.split_id)

    def _cancel(self, plan: Plan) -> None:
        for split_id in plan.split_ids:
            split = self.splits.get(split_id)
            if split is not None:
                self._drop(split)

    # ---- queries (read only) --------------------------------------------------
    def find_job(self, name: str) -> Job | None:
        job_id = self.jobs_by_name.get(name)
        return self.jobs.get(job_id) if job_id is not None else None

    def plan(self, job_id: int, consumer_index: int, epoch: int | None) -> Plan | None:
        """The consumer's newest plan, if it is of ``epoch`` (None: whatever its epoch)."""
        job = self.jobs.get(job_id)
        plan = job.plans.get(consumer_index) if job else None
        return plan if plan is not None and epoch in (None, plan.epoch) else None

    def owners(self, plan: Plan) -> list[tuple[Split, Worker]]:
        """Assigned, undelivered splits of a plan with their workers."""
        out = []
        for split_id in plan.split_ids:
            split = self.splits.get(split_id)
            if split is not None and split.worker_id is not None:
                out.append((split, self.workers[split.worker_id]))
        return out

    def job_state(self, job_id: int) -> str:
        """"running" (a consumer mid-epoch), "idle" or "finished" (every consumer
        that joined has closed or gone silent)."""
        job = self.jobs[job_id]
        if any(self.has_live_plan(job_id, c) for c in job.plans):
            return "running"
        return "finished" if job.epochs and set(job.epochs) <= job.closed else "idle"

    def has_live_plan(self, job_id: int, consumer_index: int) -> bool:
        """Whether the consumer's newest plan still has splits not delivered."""
        job = self.jobs.get(job_id)
        plan = job.plans.get(consumer_index) if job else None
        return plan is not None and any(s in self.splits for s in plan.split_ids)

    def choose_splits(self, worker_id: str, max_splits: int,
                      saturated: frozenset[tuple[int, int]] = frozenset()) -> list[int]:
        """The splits a worker asking for ``max_splits`` should get: the lowest
        unassigned ones, preferring jobs of which it holds the fewest, none of
        the ``saturated`` (job, consumer)s (the worker holds all it may for them)."""
        worker = self.workers.get(worker_id)
        if worker is None or not worker.alive:
            return []
        held = {job_id: 0 for job_id in self.unassigned}
        for split_id in worker.held:
            held[self.splits[split_id].job_id] += 1
        pools = {job_id: sorted(pool, key=lambda s: self.splits[s].key)
                 for job_id, pool in ((j, [s for s in p if (j, self.splits[s].consumer_index) not in saturated])
                                      for j, p in self.unassigned.items()) if pool}
        chosen: list[int] = []
        while len(chosen) < max_splits and pools:
            job_id = min(pools, key=lambda j: (held[j], *self.splits[pools[j][0]].key, j))
            chosen.append(pools[job_id].pop(0))
            held[job_id] += 1
            if not pools[job_id]:
                del pools[job_id]
        return chosen

    def split_at(self, plan: Plan, seq: int) -> Split | None:
        """The live split of a plan that holds batch ``seq``."""
        if plan.num_streams:
            return self.splits.get(plan.split_ids[seq % plan.num_streams])
        if seq >= plan.num_batches:
            return None
        return self.splits.get(plan.split_ids[seq // plan.split_size])

    def least_loaded_worker(self) -> Worker | None:
        alive = self.alive_workers()
        return min(alive, key=lambda w: (len(w.held), w.worker_id)) if alive else None

    def releasable(self, worker_id: str, held: list[int]) -> list[int]:
        """Of the splits a worker says it holds, those no longer assigned to it."""
        return [s for s in held
                if s not in self.splits or self.splits[s].worker_id != worker_id]

    def alive_workers(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.alive]
