"""Which splits go to which worker: the dispatcher's assignment policy, read
only over the state (the caller applies what it chooses as AssignSplits).

A worker asking for splits gets the lowest unassigned ones, job by job
preferring the jobs of which it holds the fewest, each with the same split
of the plans that share its batches (jobs of one definition: they are made
once, dpex.worker.sharing); a trainer waiting for a batch nobody holds gets
it from the least loaded worker at once. Work that
changes who gets what (sharing one computation among jobs, scaling workers to
demand) changes this room, not the state machine."""
from __future__ import annotations

import heapq

from dpex.dispatcher.state import DispatcherState, Plan, Worker
from dpex.plan import seq as seqs


def choose_splits(state: DispatcherState, worker_id: str, max_splits: int,
                  saturated: frozenset[tuple[int, int]] = frozenset()) -> list[int]:
    """The splits a worker asking for ``max_splits`` should get: the lowest
    unassigned ones, preferring jobs of which it holds the fewest, none of
    the ``saturated`` (job, consumer)s (the worker holds all it may for them).
    Costs O(consumers with work), whatever the size of their plans."""
    worker = state.workers.get(worker_id)
    if worker is None or not worker.alive or max_splits <= 0:
        return []
    held: dict[int, int] = {}
    for split_id in worker.held:
        job_id = state.splits[split_id].job_id
        held[job_id] = held.get(job_id, 0) + 1
    # One cursor per (job, consumer): the next split it would hand out.
    pending: dict[int, list] = {}
    siblings: dict[bytes, list[Plan]] = {}  # plans whose splits hold equal batches (dpex.worker.sharing)
    for job in state.jobs.values():
        for consumer, plan in job.plans.items():
            if plan.finished or (saturated and (job.job_id, consumer) in saturated) or not serves(worker, plan):
                continue
            if plan.share_key:
                siblings.setdefault(plan.share_key, []).append(plan)
            index = plan.head()
            if index is not None:
                pending.setdefault(job.job_id, []).append(
                    ((plan.epoch, plan.first_seq(index), consumer), index, plan))
    for options in pending.values():
        heapq.heapify(options)
    taken: dict[int, set[int]] = {}  # plan's first split id -> indexes chosen this call
    chosen: list[int] = []
    while len(chosen) < max_splits and pending:
        job_id = min(pending, key=lambda j: (held.get(j, 0), pending[j][0][0], j))
        options = pending[job_id]
        _, index, plan = heapq.heappop(options)
        mine = taken.setdefault(plan.first_split_id, set())
        if index not in mine:  # (else a sibling's choice took it already)
            chosen.append(plan.first_split_id + index)
            held[job_id] = held.get(job_id, 0) + 1
            mine.add(index)
            # The same split of the plans that share its batches: made once, on this worker.
            for other in siblings.get(plan.share_key, ()) if plan.share_key else ():
                theirs = taken.setdefault(other.first_split_id, set())
                if other is not plan and other.num_splits == plan.num_splits and _unassigned(other, index, theirs):
                    chosen.append(other.first_split_id + index)
                    held[other.job_id] = held.get(other.job_id, 0) + 1
                    theirs.add(index)
        following = _after(plan, mine)
        if following is not None:
            heapq.heappush(options, ((plan.epoch, plan.first_seq(following), plan.consumer_index),
                                     following, plan))
        if not options:
            del pending[job_id]
    return chosen


def _after(plan: Plan, taken: set[int]) -> int | None:
    """The plan's lowest unassigned split not in ``taken``."""
    back = sorted(i for i in plan.returned if i not in taken)[:1]
    fresh = plan.next_index
    while fresh < plan.num_splits and (fresh in plan.early or fresh in taken):
        fresh += 1
    options = back + ([fresh] if fresh < plan.num_splits else [])
    return min(options) if options else None


def _unassigned(plan: Plan, index: int, taken: set[int]) -> bool:
    """Split ``index`` of the plan waits for a worker (and was not chosen in this call)."""
    if index in taken:
        return False
    return index in plan.returned or (plan.next_index <= index < plan.num_splits and index not in plan.early)


def owner_for(state: DispatcherState, plan: Plan, seq: int) -> tuple[str, int] | None:
    """(worker id, split id): the least loaded live worker for the plan's
    split holding batch ``seq``, if no worker has it and it is not done."""
    split_id = unassigned_split_of(state, plan, seq)
    worker = least_loaded_worker(state) if split_id is not None else None
    return (worker.worker_id, split_id) if worker is not None else None


def unassigned_split_of(state: DispatcherState, plan: Plan, seq: int) -> int | None:
    """The id of the plan's split holding batch ``seq`` if no worker has it
    and it is not done; else None."""
    index = seqs.split_index(seq, plan.split_size, plan.num_streams)
    if plan.finished or index >= plan.num_splits:
        return None
    split = state.splits.get(plan.first_split_id + index)
    if split is None and (index < plan.next_index or index in plan.early):
        return None  # delivered already
    return plan.first_split_id + index if split is None or split.worker_id is None else None


def least_loaded_worker(state: DispatcherState) -> Worker | None:
    """The live worker holding the fewest splits."""
    alive = state.alive_workers()
    return min(alive, key=lambda w: (len(w.held), w.worker_id)) if alive else None


def serves(worker: Worker, plan: Plan) -> bool:
    """Whether the worker can make the plan's batches: a sampler described with
    one torch release is run by workers of that release only (another's
    samplers may draw other indices). A worker that did not say (an older
    one) is given them, and refuses a mismatch itself."""
    sampler = plan.sampler
    return (sampler is None or sampler.kind == sampler.SHUFFLE or not sampler.torch_version
            or not worker.versions.torch or sampler.torch_version == worker.versions.torch)
