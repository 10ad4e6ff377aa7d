"""What `dpex status` and the metrics endpoint show: workers, jobs and
counters, read under the dispatcher's lock."""
from __future__ import annotations

import time

from dpex.dispatcher.journaled import Journaled
from dpex.proto import dispatcher_pb2 as dpb


def status(j: Journaled) -> dpb.GetStatusResponse:
    """Workers, jobs and counters; ``workers_needed`` is how many workers the
    trainers' measured rates call for (0: no trainer said)."""
    now = time.monotonic()
    state = j.state
    with j.lock:
        response = dpb.GetStatusResponse(splits_assigned_total=state.splits_assigned_total,
                                         splits_reassigned_total=state.splits_reassigned_total,
                                         uptime_s=now - j.started,
                                         jobs_collected_total=state.jobs_collected_total,
                                         workers_forgotten_total=state.workers_forgotten_total,
                                         worker_heartbeats_total=j.heartbeats)
        for w in state.workers.values():
            response.workers.add(worker_id=w.worker_id, address=w.address,
                                 state="alive" if w.alive else "left" if w.left else "lost",
                                 splits_held=len(w.held),
                                 seconds_since_heartbeat=j.seen.since_heartbeat(w.worker_id),
                                 load=j.seen.loads.get(w.worker_id) if w.alive else None)
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
                              workers_needed=j.seen.workers_needed(job.job_id),
                              shares=(job.share_digest or b"").hex()[:8])
    alive = sum(w.state == "alive" for w in response.workers)
    extra = [max(0, job.workers_needed - alive) for job in response.jobs if job.workers_needed]
    response.workers_needed = alive + sum(extra) if extra else 0
    with j.lock:
        if j.scaled is not None:
            response.workers_wanted, response.scaling_reason = j.scaled.target, j.scaled.reason
    return response
