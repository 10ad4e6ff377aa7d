"""Which batch a worker's pool makes next, of the batches its scheduler
knows (dpex.worker.scheduler holds its lock and passes its state in).

A batch a trainer waits for first, the lowest of the job whose turn it is.
Then one made ahead, for a consumer with room in its share of the buffer;
a newcomer whose share is taken by consumers that were alone before gets it
back: the newest ready batch of the consumer most over its share is dropped
(made again when asked)."""
from __future__ import annotations

from typing import Callable, Collection

from dpex.worker.budget import Budget, Consumer
from dpex.worker.queues import Queues
from dpex.wire.batchkey import Key
from dpex.worker.runners import Held


def next_key(queues: Queues, budget: Budget, held: Held, running: Collection[Key],
             drop_ready: Callable[[Consumer, int], int]) -> Key | None:
    """The batch to make next (None: none now). ``drop_ready(consumer, keep)``
    frees a consumer's ready batches beyond its ``keep`` lowest."""
    key = queues.pick(lambda c, q: q.head(q.urgent, lambda k: held.waited(k) and k not in running))
    if key is not None:
        return key
    active = queues.active(budget)

    def evict(consumers) -> bool:
        """Drops the newest ready batch of the consumer most over its share, if any."""
        victim = budget.over_share(active, consumers)
        if victim is not None:
            drop_ready(victim, budget.holding(victim).ready - 1)
        return victim is not None

    def ahead(blocked: list[Consumer]) -> Key | None:
        """The lowest batch to make ahead, of the job whose turn it is, of a consumer
        with room in its share; those with no room in the whole buffer go to ``blocked``."""
        def choose(c: Consumer, q) -> Key | None:
            if q.idle or not budget.room(c, active):
                return None
            key = q.head(q.pending, lambda k: k not in running)
            if key is not None and not budget.fits(c):
                blocked.append(c)
                return None
            return key
        return queues.pick(choose)

    # Within the memory bound: a newcomer's first batch, of a size not known before, may have gone over it.
    while budget.total_bytes() > budget.max_bytes and evict(queues):
        pass
    blocked: list[Consumer] = []
    key = ahead(blocked)
    if key is not None or not blocked:
        return key
    # The memory is full of batches of consumers over their share (they
    # were alone when they made them): evict one so that a newcomer gets its share.
    if not evict([c for c in queues if c not in blocked]):
        return None
    return ahead([])
