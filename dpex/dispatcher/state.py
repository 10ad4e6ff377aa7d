"""The dispatcher's state, as a pure state machine.

Every change is one ``Update`` record (journal.proto) passed to
:meth:`DispatcherState.apply`, which does no I/O, reads no clock and takes no
lock. The service validates a request, builds the update and applies it under
its own lock, so that replaying the same updates rebuilds the same state (ids
the state allocates, like split ids, are deterministic).

A plan is cut into splits of ``split_size`` batches without making them: a
plan of a billion samples costs what one of a thousand does. A split becomes
an object when it is handed out (the lowest first: a cursor over the plan,
and a heap of those given back by lost workers) and is dropped when
delivered, so memory and the cost of each call follow the splits in work,
not the size of the plans.
"""
from __future__ import annotations

import bisect
import functools
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from dpex.plan import seq as seqs
from dpex.plan.spec import share_digest
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


_REMEMBER_COLLECTED = 10_000  # collected job ids kept, to tell a returning trainer what happened


@dataclass
class Changes:
    """What updates touched since the service last looked (to wake only the
    long polls that wait for it)."""
    workers: set[str] = field(default_factory=set)              # whose assigned splits changed
    consumers: set[tuple[int, int]] = field(default_factory=set)  # (job, consumer): owners changed
    splits_freed: int = 0         # splits that became available to workers
    plans_ended: int = 0          # plans delivered in full or cancelled
    settled: dict[str, set[int]] = field(default_factory=dict)  # worker -> its splits delivered in full


@dataclass
class Worker:
    worker_id: str
    address: str
    alive: bool = True
    left: bool = False  # deregistered (drained), not lost
    held: set[int] = field(default_factory=set)  # assigned splits not yet delivered
    versions: dpb.Versions = field(default_factory=dpb.Versions)  # as it registered (dpex.version)


@dataclass
class Plan:
    job_id: int
    consumer_index: int
    epoch: int
    plan_hash: bytes
    split_size: int
    num_batches: int
    first_split_id: int
    num_splits: int
    base_seed: int = 0
    num_streams: int = 0  # > 0: one split per stream, lengths unknown
    sampler: dpb.SamplerSpec | None = None  # torch's sampler, described: workers compute the batches
    plan_file: str = ""                     # explicit batches, in the dispatcher's plan files
    inline: list[dpb.IndexBatch] = field(default_factory=list)  # explicit batches in the record itself
    num_delivered: int = 0
    next_index: int = 0           # splits below it were handed out (or are done)
    early: set[int] = field(default_factory=set)      # handed out ahead of next_index
    returned: list[int] = field(default_factory=list)  # heap: handed out, then given back unassigned
    live: set[int] = field(default_factory=set)       # split ids handed out and not done
    done: int = 0                 # splits delivered or cancelled
    resumed: list[tuple[int, int]] = field(default_factory=list)  # seq ranges delivered before a checkpoint
    stream_starts: dict[int, dpb.StreamStart] = field(default_factory=dict)  # stream -> where it goes on
    share_key: bytes = b""        # equal for plans whose splits hold equal batches (b"": none)
    attempt: int = 0              # the iter() that submitted it (SubmitPlanRequest.attempt; 0: not told)

    @classmethod
    def from_record(cls, u: jpb.SubmitPlan, first_split_id: int, **progress: Any) -> "Plan":
        """The plan a SubmitPlan record makes (with ``progress`` as a snapshot keeps it)."""
        size = max(1, u.split_size)
        num_batches = u.num_batches or len(u.batches)  # older records hold their batches
        plan = cls(u.job_id, u.consumer_index, u.epoch, u.plan_hash, size, num_batches, first_split_id,
                   u.num_streams or -(-num_batches // size), u.base_seed, u.num_streams,
                   sampler=u.sampler if u.HasField("sampler") else None, plan_file=u.plan_file,
                   inline=list(u.batches), resumed=[(r.start, r.end) for r in u.done],
                   stream_starts={s.stream: s for s in u.stream_starts}, share_key=u.share_key,
                   attempt=u.attempt, **progress)
        if not progress:
            plan._skip_resumed()
        return plan

    def _skip_resumed(self) -> None:
        """A resumed epoch's splits delivered in full before the checkpoint are
        done: never handed out (a prefix moves the cursor; others count as handed out early)."""
        if self.num_streams:
            return  # (streams resume by skipping: their splits' delivered seqs)
        for start, end in self.resumed:
            last = min(end, self.num_batches)
            for index in range(-(-start // self.split_size), self.num_splits):
                if self.first_seq(index) + self.split_batches(index) > last:
                    break
                if index == self.next_index:
                    self.next_index += 1
                else:
                    self.early.add(index)
                self.done += 1
        self.pass_early()

    def pass_early(self) -> None:
        """Moves the cursor past splits handed out (or done) ahead of it."""
        while self.next_index in self.early:
            self.early.discard(self.next_index)
            self.next_index += 1

    def resumed_in(self, first_seq: int, count: int) -> set[int]:
        """The seqs of ``first_seq .. +count`` delivered before the checkpoint."""
        split = seqs.split_seqs(first_seq, count)
        return {s for start, end in self.resumed for s in range(max(start, split.start), min(end, split.stop))}

    @property
    def split_ids(self) -> range:
        return range(self.first_split_id, self.first_split_id + self.num_splits)

    @property
    def finished(self) -> bool:
        return self.done >= self.num_splits

    def first_seq(self, index: int) -> int:
        return seqs.first_seq(index, self.split_size, self.num_streams)

    def split_batches(self, index: int) -> int:
        """How many batches split ``index`` holds (0: a stream, length unknown)."""
        if self.num_streams:
            return 0
        return min(self.split_size, self.num_batches - index * self.split_size)

    def head(self) -> int | None:
        """The lowest split index not assigned and not done."""
        fresh = self.next_index if self.next_index < self.num_splits else None
        back = self.returned[0] if self.returned else None
        if fresh is None or (back is not None and back < fresh):
            return back
        return fresh

    def unassigned(self) -> int:
        return self.num_splits - self.next_index - len(self.early) + len(self.returned)


@dataclass
class Split:
    """A handed-out split of a plan."""
    split_id: int
    plan: Plan
    index: int
    worker_id: str | None = None
    delivered: set[int] = field(default_factory=set)  # seqs

    @property
    def job_id(self) -> int:
        return self.plan.job_id

    @property
    def consumer_index(self) -> int:
        return self.plan.consumer_index

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def first_seq(self) -> int:
        return self.plan.first_seq(self.index)

    @property
    def num_batches(self) -> int:
        return self.plan.split_batches(self.index)


@dataclass
class Job:
    job_id: int
    definition: dpb.JobDef
    plans: dict[int, Plan] = field(default_factory=dict)  # consumer -> newest plan
    epochs: dict[int, int] = field(default_factory=dict)  # consumer -> newest epoch it planned
    closed: set[int] = field(default_factory=set)         # consumers gone (closed or silent)
    share_keys: dict[int, bytes] = field(default_factory=dict)  # consumer -> its newest plan's, kept after release
    batches_planned: int = 0
    batches_delivered: int = 0

    @functools.cached_property
    def share_digest(self) -> bytes | None:
        """What the job shares with jobs of its definition (dpex.plan.spec.share_digest),
        hashed once: the definition holds the pickled dataset, and never changes."""
        return share_digest(self.definition)


class DispatcherState:
    """All dispatcher state; mutate it only through :meth:`apply`."""

    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}
        self._alive: list[Worker] | None = None  # alive_workers(), until a worker comes or goes
        self.jobs: dict[int, Job] = {}
        self.jobs_by_name: dict[str, int] = {}
        self.splits: dict[int, Split] = {}          # handed out, not delivered, not cancelled
        self.next_split_id = 1
        self.splits_assigned_total = 0    # counters for metrics; replay rebuilds them too
        self.splits_reassigned_total = 0
        self.jobs_collected_total = 0
        self.workers_forgotten_total = 0
        self.collected: OrderedDict[int, str] = OrderedDict()  # recently collected job ids -> names
        self._starts: list[int] = []      # first split ids of the live plans, ascending
        self._by_start: dict[int, Plan] = {}
        self.changes = Changes()

    def take_changes(self) -> Changes:
        """What the updates applied since the last call touched."""
        changes, self.changes = self.changes, Changes()
        return changes

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
        self.workers[u.worker_id] = Worker(u.worker_id, u.address, versions=u.versions)
        self._alive = None

    def _apply_worker_lost(self, u: jpb.WorkerLost) -> None:
        worker = self.workers.get(u.worker_id)
        if worker is not None:
            self._lose(worker)
            worker.left = u.left

    def _apply_forget_worker(self, u: jpb.ForgetWorker) -> None:
        worker = self.workers.get(u.worker_id)
        if worker is not None and not worker.alive:
            del self.workers[u.worker_id]
            self._alive = None
            self.workers_forgotten_total += 1

    def _apply_remove_job(self, u: jpb.RemoveJob) -> None:
        job = self.jobs.pop(u.job_id, None)
        if job is None:
            return
        for plan in job.plans.values():
            self._cancel(plan)  # its workers are told to drop the splits at their next heartbeat
        if self.jobs_by_name.get(job.definition.name) == u.job_id:
            del self.jobs_by_name[job.definition.name]
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

    def _apply_submit_plan(self, u: jpb.SubmitPlan) -> Plan:
        job = self.jobs[u.job_id]
        old = job.plans.get(u.consumer_index)
        if old is not None and old.epoch == u.epoch and old.plan_hash == u.plan_hash:
            return old  # the same plan again: a reconnect, keep the progress
        if old is not None:
            self._cancel(old)
        plan = Plan.from_record(u, self.next_split_id)
        self.next_split_id += plan.num_splits
        self.track(plan)
        if plan.finished:  # a resumed epoch the trainer had all of
            self._forget(plan)
        job.plans[u.consumer_index] = plan
        job.epochs[u.consumer_index] = u.epoch
        job.share_keys[u.consumer_index] = u.share_key
        job.closed.discard(u.consumer_index)
        job.batches_planned += plan.num_batches
        self.changes.consumers.add((u.job_id, u.consumer_index))
        self.changes.splits_freed += plan.num_splits
        return plan

    def _apply_assign_splits(self, u: jpb.AssignSplits) -> list[int]:
        worker = self.workers.get(u.worker_id)
        if worker is None or not worker.alive:
            return []
        assigned = []
        for split_id in u.split_ids:
            plan = self.plan_of(split_id)
            if plan is not None and self._hand_out(plan, split_id - plan.first_split_id, worker):
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
            split = self.splits.get(plan.first_split_id + seqs.split_index(seq, plan.split_size))
            if split is None or seq in split.delivered:
                continue  # done already (or never handed out: nobody could have made it)
            split.delivered.add(seq)
            newly += 1
            if len(split.delivered) == split.num_batches:
                self._drop(split, wake_worker=False)
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

    def track(self, plan: Plan) -> None:
        """Makes a plan's split ids found (from apply, or restoring a snapshot)."""
        if plan.num_splits:
            bisect.insort(self._starts, plan.first_split_id)
            self._by_start[plan.first_split_id] = plan

    # ---- helpers (called only from apply) ----------------------------------
    def plan_of(self, split_id: int) -> Plan | None:
        at = bisect.bisect_right(self._starts, split_id) - 1
        plan = self._by_start.get(self._starts[at]) if at >= 0 else None
        return plan if plan is not None and split_id < plan.first_split_id + plan.num_splits else None

    def _hand_out(self, plan: Plan, index: int, worker: Worker) -> bool:
        """Assigns split ``index`` of a plan to the worker, if it is unassigned."""
        split_id = plan.first_split_id + index
        split = self.splits.get(split_id)
        if split is not None:
            if split.worker_id is not None:
                return False
            plan.returned.remove(index)
            heapq.heapify(plan.returned)
        elif index < plan.next_index or index in plan.early or plan.finished:
            return False  # done already
        else:
            if index == plan.next_index:
                plan.next_index += 1
                plan.pass_early()
            else:
                plan.early.add(index)  # the split a consumer waits for, ahead of the others
            split = self.splits[split_id] = Split(split_id, plan, index)
            if plan.resumed:
                split.delivered = plan.resumed_in(split.first_seq, split.num_batches)
            plan.live.add(split_id)
        split.worker_id = worker.worker_id
        worker.held.add(split_id)
        self.splits_assigned_total += 1
        self.changes.workers.add(worker.worker_id)
        self.changes.consumers.add((plan.job_id, plan.consumer_index))
        return True

    def _lose(self, worker: Worker) -> None:
        worker.alive = False
        self._alive = None
        for split_id in worker.held:
            split = self.splits[split_id]
            split.worker_id = None
            heapq.heappush(split.plan.returned, split.index)
            self.changes.consumers.add((split.job_id, split.consumer_index))
        self.splits_reassigned_total += len(worker.held)
        self.changes.workers.add(worker.worker_id)
        self.changes.splits_freed += len(worker.held)
        worker.held.clear()

    def _drop(self, split: Split, wake_worker: bool = True) -> None:
        """The split is done: delivered in full, or cancelled. A worker is woken
        to drop a cancelled split at once (it frees what it holds for it); a
        delivered one it drops with its next heartbeat's answer (nothing of it is
        held any more): one call per split fewer."""
        plan = split.plan
        del self.splits[split.split_id]
        plan.live.discard(split.split_id)
        plan.done += 1
        self.changes.consumers.add((plan.job_id, plan.consumer_index))
        if split.worker_id is None:
            plan.returned.remove(split.index)
            heapq.heapify(plan.returned)
        elif split.worker_id in self.workers:
            self.workers[split.worker_id].held.discard(split.split_id)
            if wake_worker:
                self.changes.workers.add(split.worker_id)
            else:
                self.changes.settled.setdefault(split.worker_id, set()).add(split.split_id)
        if plan.finished:
            self._forget(plan)

    def _cancel(self, plan: Plan) -> None:
        for split_id in list(plan.live):
            self._drop(self.splits[split_id])
        plan.done = plan.num_splits
        plan.next_index, plan.early, plan.returned = plan.num_splits, set(), []
        self.changes.consumers.add((plan.job_id, plan.consumer_index))
        self._forget(plan)

    def _forget(self, plan: Plan) -> None:
        """No split of the plan is in work any more: its ids need no lookup."""
        if self._by_start.get(plan.first_split_id) is plan:
            self.changes.plans_ended += 1
            del self._by_start[plan.first_split_id]
            self._starts.pop(bisect.bisect_left(self._starts, plan.first_split_id))

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
        """Assigned, undelivered splits of a plan with their workers, in order."""
        out = []
        for split_id in sorted(plan.live):
            split = self.splits[split_id]
            if split.worker_id is not None:
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
        return plan is not None and not plan.finished

    def unassigned(self, job_id: int) -> int:
        """How many splits of the job wait for a worker."""
        job = self.jobs.get(job_id)
        return sum(p.unassigned() for p in job.plans.values() if not p.finished) if job else 0

    def releasable(self, worker_id: str, held: list[int]) -> list[int]:
        """Of the splits a worker says it holds, those no longer assigned to it."""
        return [s for s in held
                if s not in self.splits or self.splits[s].worker_id != worker_id]

    def alive_workers(self) -> list[Worker]:
        """The workers alive now (a list shared until one comes or goes: not to be changed)."""
        if self._alive is None:
            self._alive = [w for w in self.workers.values() if w.alive]
        return self._alive
