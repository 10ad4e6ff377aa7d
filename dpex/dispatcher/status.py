"""What `dpex status` and the metrics endpoint show: workers, jobs and
counters, read under the dispatcher's lock."""
from __future__ import annotations

import time
from typing import Iterable

from dpex import version
from dpex.auth import refusals
from dpex.dispatcher.journaled import Journaled
from dpex.dispatcher.state import Job
from dpex.plan.spec import content_differences
from dpex.proto import dispatcher_pb2 as dpb


def status(core: Journaled) -> dpb.GetStatusResponse:
    """Workers, jobs and counters; ``workers_needed`` is how many workers the
    trainers' measured rates call for (0: no trainer said)."""
    now = time.monotonic()
    state = core.state
    with core.lock:
        response = dpb.GetStatusResponse(splits_assigned_total=state.splits_assigned_total,
                                         splits_reassigned_total=state.splits_reassigned_total,
                                         uptime_s=now - core.started,
                                         jobs_collected_total=state.jobs_collected_total,
                                         workers_forgotten_total=state.workers_forgotten_total,
                                         worker_heartbeats_total=core.heartbeats)
        response.versions.CopyFrom(version.versions())
        if core.store is not None:
            response.journal_write_errors_total, response.journal_failing = core.store.write_errors, core.store.failing
        response.refused_calls_total.update(core.keys.refusals.counts + refusals.counts)  # by keys, by token
        for w in state.workers.values():
            response.workers.add(worker_id=w.worker_id, address=w.address,
                                 state="alive" if w.alive else "left" if w.left else "lost",
                                 splits_held=len(w.held),
                                 seconds_since_heartbeat=core.seen.since_heartbeat(w.worker_id),
                                 versions=w.versions,
                                 load=core.seen.loads.get(w.worker_id) if w.alive else None)
        assigned = {job_id: 0 for job_id in state.jobs}
        for split in state.splits.values():
            if split.worker_id is not None and split.job_id in assigned:
                assigned[split.job_id] += 1
        for job in state.jobs.values():
            response.jobs.add(job_id=job.job_id, name=job.definition.name,
                              num_consumers=job.definition.num_consumers,
                              batches_planned=job.batches_planned,
                              batches_delivered=job.batches_delivered,
                              splits_unassigned=state.unassigned(job.job_id),
                              splits_assigned=assigned[job.job_id],
                              consumers_active=sum(state.has_live_plan(job.job_id, c) for c in job.plans),
                              epochs=[job.epochs[c] for c in sorted(job.epochs)],
                              state=state.job_state(job.job_id),
                              workers_needed=core.seen.workers_needed(job.job_id),
                              shares=(job.share_digest or b"").hex()[:8],
                              sharing=sharing(job, state.jobs.values()),
                              bottleneck=core.seen.verdict(job.job_id))
    alive = sum(w.state == "alive" for w in response.workers)
    extra = [max(0, job.workers_needed - alive) for job in response.jobs if job.workers_needed]
    response.workers_needed = alive + sum(extra) if extra else 0
    with core.lock:
        if core.scaled is not None:
            response.workers_wanted, response.scaling_reason = core.scaled.target, core.scaled.reason
    return response


def sharing(job: Job, jobs: Iterable[Job]) -> str:
    """Whether the job's batches are shared and, if not, why, in words (for a
    sweep whose trials share nothing: dpex.plan.spec.share_digest)."""
    definition = job.definition
    if definition.no_share:
        return "off: share=False"
    if definition.process_seeds:
        return "off: reproducible=False (a sample's draws follow the process that makes it)"
    keys = _share_keys(job)
    if keys == {b""}:  # plans of no key from a job that may share: its streams
        return "off: an IterableDataset's streams are not shared"
    others = [other for other in jobs if other.job_id != job.job_id]
    kin = [other for other in others if other.share_digest == job.share_digest]
    if kin:
        keys -= {b""}
        with_ = [other for other in kin if keys & _share_keys(other)]
        if with_:
            return f"with {len(with_)} job{'s' * (len(with_) > 1)}"
        return (f"none: {len(kin)} job{'s' * (len(kin) > 1)} of its definition plan other batches "
                "(another seed, epoch or sampler)")
    # The same code (by content) with other settings: the nearest job that shares, and how it differs.
    near = [(content_differences(other.definition, definition), other) for other in others
            if definition.content and other.definition.content == definition.content and other.share_digest]
    if near:
        differ, other = min(near, key=lambda pair: len(pair[0]))
        return f"none: job {other.definition.name or other.job_id} differs in {', '.join(differ)}"
    return ""


def _share_keys(job: Job) -> set[bytes]:
    """The share keys of each consumer's newest plan (dpex.plan.spec.plan_share_key), released or not."""
    return set(job.share_keys.values()) | {plan.share_key for plan in job.plans.values()}
