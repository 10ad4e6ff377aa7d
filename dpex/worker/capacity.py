"""How many more splits a worker takes, and the consumers it takes none of:
what its heartbeat asks the dispatcher for.

Held splits with batches still to make count, unless their consumer is
saturated: it holds its whole share of the buffer, or its trainer left
(idle). A slow consumer's splits must not keep the other jobs' out, and the
worker must not take more of them either. Batches made wait in the bounded
buffer, and must not stop the worker from taking the split a trainer waits
for. A consumer whose split waits for its epoch's permutation to be drawn
takes one split's room, and no more splits until it is drawn (a draw of
10^8 samples takes seconds).

Past ``max_held_splits``, one more split at a time while the held ones have
fewer batches left than the pool runs at once: small splits must not leave
a many-process worker's processes idle.

Pure: the scheduler calls it under its lock.
"""
from __future__ import annotations

from typing import Iterable

from dpex.worker.budget import Budget, Consumer
from dpex.worker.queues import Queues
from dpex.worker.runners import SplitRunner


def wanted(held: Iterable[SplitRunner], queues: Queues, budget: Budget, active: int, *,
           max_held_splits: int, max_inflight: int) -> tuple[int, set[Consumer]]:
    """(splits to take, saturated consumers) for ``active`` consumers sharing the buffer."""
    held = list(held)
    drawing = {runner.consumer for runner in held if not runner.planned}
    saturated = drawing | {c for c, q in queues.items() if q.idle or not budget.room(c, active)}
    busy = [runner.unproduced() for runner in held if runner.unproduced() and runner.consumer not in saturated]
    want = max_held_splits - len(drawing) - len(busy)
    if want <= 0 and not drawing and sum(busy) < max_inflight:
        want = 1
    return max(0, want), saturated
