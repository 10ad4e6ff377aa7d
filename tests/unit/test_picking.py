"""dpex.worker.picking, without a scheduler's thread or a pool: which batch next."""
from dpex.worker import picking
from dpex.worker.budget import Budget
from dpex.worker.queues import Queues
from dpex.wire.batchkey import Key
from dpex.worker.runners import Held


def test_the_next_batch_ahead_is_the_lowest_not_running_and_none_once_the_read_ahead_is_full():
    queues, budget, held = Queues(), Budget(2, 1 << 30), Held()
    consumer = (9, 0)
    for seq in (2, 0, 1):
        queues.of(consumer).add(Key(0, seq, 0, 9), urgent=False)
    never = lambda c, keep: 0  # noqa: E731 - nothing ready to drop here
    assert picking.next_key(queues, budget, held, set(), never) == Key(0, 0, 0, 9)
    assert picking.next_key(queues, budget, held, {Key(0, 0, 0, 9)}, never) == Key(0, 1, 0, 9)
    budget.started(consumer)
    budget.started(consumer)  # its read-ahead (2 batches) is full
    assert picking.next_key(queues, budget, held, {Key(0, 0, 0, 9), Key(0, 1, 0, 9)}, never) is None
