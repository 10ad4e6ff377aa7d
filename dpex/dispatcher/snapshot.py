"""The dispatcher's whole state as one record, and back.

A snapshot holds what is live: workers, jobs, their newest plans and the
splits in work. Plans keep the record that made them (a description, a plan
file or, from older journals, the batches) and their progress, not the
history of their acknowledgements.
"""
from __future__ import annotations

import heapq

from dpex.dispatcher.state import DispatcherState, Job, Plan, Split, Worker
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


def take(state: DispatcherState) -> jpb.Snapshot:
    snap = jpb.Snapshot(next_split_id=state.next_split_id,
                        splits_assigned_total=state.splits_assigned_total,
                        splits_reassigned_total=state.splits_reassigned_total,
                        jobs_collected_total=state.jobs_collected_total,
                        workers_forgotten_total=state.workers_forgotten_total)
    for w in state.workers.values():
        snap.workers.add(worker_id=w.worker_id, address=w.address, alive=w.alive, left=w.left, versions=w.versions)
    for job in state.jobs.values():
        out = snap.jobs.add(created=jpb.CreateJob(job_id=job.job_id, job=job.definition),
                            epochs=job.epochs, closed=sorted(job.closed),
                            batches_planned=job.batches_planned, batches_delivered=job.batches_delivered)
        for plan in job.plans.values():
            p = out.plans.add(
                submitted=jpb.SubmitPlan(
                    job_id=plan.job_id, consumer_index=plan.consumer_index, epoch=plan.epoch,
                    plan_hash=plan.plan_hash, split_size=plan.split_size, base_seed=plan.base_seed,
                    attempt=plan.attempt,
                    num_streams=plan.num_streams, sampler=plan.sampler, plan_file=plan.plan_file,
                    num_batches=plan.num_batches, batches=plan.inline,
                    done=[dpb.SeqRange(start=a, end=b) for a, b in plan.resumed],
                    stream_starts=[plan.stream_starts[k] for k in sorted(plan.stream_starts)],
                    share_key=plan.share_key),
                first_split_id=plan.first_split_id, num_delivered=plan.num_delivered,
                next_index=plan.next_index, early=sorted(plan.early), returned=sorted(plan.returned),
                done=plan.done)
            for split_id in sorted(plan.live):
                split = state.splits[split_id]
                p.splits.add(index=split.index, worker_id=split.worker_id or "",
                             delivered=sorted(split.delivered))
    for job_id, name in state.collected.items():
        snap.collected.add(job_id=job_id, name=name)
    return snap


def restore(snap: jpb.Snapshot) -> DispatcherState:
    state = DispatcherState()
    state.next_split_id = snap.next_split_id
    state.splits_assigned_total = snap.splits_assigned_total
    state.splits_reassigned_total = snap.splits_reassigned_total
    state.jobs_collected_total = snap.jobs_collected_total
    state.workers_forgotten_total = snap.workers_forgotten_total
    for w in snap.workers:
        state.workers[w.worker_id] = Worker(w.worker_id, w.address, w.alive, w.left, versions=w.versions)
    for j in snap.jobs:
        definition = dpb.JobDef()
        definition.CopyFrom(j.created.job)
        job = state.jobs[j.created.job_id] = Job(j.created.job_id, definition, epochs=dict(j.epochs),
                                                 closed=set(j.closed), batches_planned=j.batches_planned,
                                                 batches_delivered=j.batches_delivered)
        if definition.name:
            state.jobs_by_name[definition.name] = job.job_id
        for p in j.plans:
            plan = Plan.from_record(p.submitted, p.first_split_id, num_delivered=p.num_delivered,
                                    next_index=p.next_index, early=set(p.early), returned=list(p.returned),
                                    done=p.done)
            heapq.heapify(plan.returned)
            job.plans[plan.consumer_index] = plan
            for s in p.splits:
                split_id = plan.first_split_id + s.index
                split = state.splits[split_id] = Split(split_id, plan, s.index, s.worker_id or None,
                                                       set(s.delivered))
                plan.live.add(split_id)
                if split.worker_id is not None:
                    state.workers[split.worker_id].held.add(split_id)
            if not plan.finished:
                state.track(plan)
    for c in snap.collected:
        state.collected[c.job_id] = c.name
    return state
