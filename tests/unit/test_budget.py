"""Each consumer's share of what a worker makes ahead, and turns across jobs."""
from dpex.worker.budget import Budget, Turns

A, B = (1, 0), (2, 0)


def test_each_consumer_has_its_own_depth_and_an_equal_part_of_memory():
    budget = Budget(max_batches=3, max_bytes=1000)
    for _ in range(3):
        assert budget.room(A, active=1)
        budget.started(A)
        budget.stopped(A)
        budget.readied(A, 200)
    assert not budget.room(A, active=1)  # its depth
    assert budget.room(B, active=2)      # B's own depth is untouched
    assert budget.share(2) == (3, 500)
    assert budget.over_share(2, [A, B]) == A  # 600 bytes over a share of 500
    budget.taken(A, 200)
    assert budget.over_share(2, [A, B]) is None and budget.total_bytes() == 400


def test_memory_bound_counts_running_batches_at_their_consumers_last_size():
    budget = Budget(max_batches=8, max_bytes=1000)
    budget.readied(A, 400)
    budget.started(A)  # estimated at 400 while it runs
    assert budget.total_bytes() == 800
    assert not budget.fits(A) and not budget.room(A, active=1)
    assert budget.fits(B)  # B's size is not known yet: its first batch may start


def test_turns_go_to_the_job_served_longest_ago():
    turns = Turns()
    for job in (1, 2, 3):
        turns.add(job)
    served = [turns.pick(lambda j: j if j != 2 else None) for _ in range(4)]
    assert served == [1, 3, 1, 3]
    turns.remove(1)
    assert turns.pick(lambda j: j) == 2


def test_a_workers_default_read_ahead_covers_its_processes():
    from dpex.config import WorkerConfig
    assert WorkerConfig(dispatcher="h:1", processes=2).buffer_batches == 8
    assert WorkerConfig(dispatcher="h:1", processes=12).buffer_batches == 12  # one consumer can fill them
    assert WorkerConfig(dispatcher="h:1", processes=12, buffer_batches=3).buffer_batches == 3  # as asked
