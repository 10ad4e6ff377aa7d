"""dpex.worker.pool.BatchPool: which process makes a batch, and a crash."""
import os
import signal

import pytest

from dpex.worker import runtime
from dpex.worker.pool import BatchPool


def whoami(_=None):
    return runtime.current().index, os.getpid()


def die(_=None):
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture(scope="module")
def in_turn():
    pool = BatchPool(3, "test-worker", shared_memory=False, in_turn=True)
    yield pool
    pool.close()


def test_in_turn_each_process_takes_every_nth_batch_of_a_lane(in_turn):
    ids = [in_turn.submit(whoami, lane=("job", 0, 1)).result()[0] for _ in range(7)]
    assert ids == [0, 1, 2, 0, 1, 2, 0]
    # another epoch starts its cycle at process 0 again, as torch's workers
    assert [in_turn.submit(whoami, lane=("job", 0, 2)).result()[0] for _ in range(2)] == [0, 1]


def test_in_turn_a_killed_process_fails_its_batch_and_alone_starts_again(in_turn):
    before = {in_turn.submit(whoami, lane="x").result() for _ in range(3)}
    lane = ("crash", 0, 0)
    with pytest.raises(Exception):
        in_turn.submit(die, lane=lane).result(timeout=60)  # process 0
    death = in_turn.death()
    assert death is not None and death[1] == -signal.SIGKILL
    after = [in_turn.submit(whoami, lane=lane).result(timeout=120) for _ in range(3)]  # processes 1, 2, then 0 again
    assert [i for i, _ in after] == [1, 2, 0]
    survivors = {pid for i, pid in before if i != 0}
    assert {pid for i, pid in after if i != 0} == survivors  # the others were not restarted
    assert after[2][1] not in {pid for _, pid in before}


def test_shared_the_first_free_process_takes_a_batch():
    pool = BatchPool(2, "test-worker", shared_memory=False)
    try:
        ids = {pool.submit(whoami, lane=("job", 0, 1)).result()[0] for _ in range(6)}
        assert ids <= {0, 1}
        with pytest.raises(Exception):
            pool.submit(die).result(timeout=60)
        assert pool.submit(whoami).result(timeout=120)[0] in (0, 1)  # the pool started again
    finally:
        pool.close()


def test_a_death_is_reported_while_the_executors_thread_is_still_storing_its_code():
    """The executor's thread reaps a dead process (waitpid) and stores its code
    a moment later; death() asked in between found no child to wait for and
    reported no death (a fresh-clone CI saw it once)."""
    import multiprocessing
    import threading
    import types

    p = multiprocessing.get_context("fork").Process(target=die)
    p.start()
    _, status = os.waitpid(p.pid, 0)  # as the executor's thread does first...
    stored = threading.Event()

    def store_later():
        stored.wait(5)  # ...and then, once death() has found no child, stores the code
        p._popen.returncode = os.waitstatus_to_exitcode(status)
    threading.Thread(target=store_later).start()
    original = p._popen.poll

    def poll(flag=os.WNOHANG):
        got = original(flag)  # ECHILD: None
        stored.set()
        return got
    p._popen.poll = poll
    death = BatchPool._death_of(types.SimpleNamespace(_slots=[]), [[p]])
    assert death is not None and death[:2] == (p.pid, -signal.SIGKILL)
