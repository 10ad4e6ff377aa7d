"""dpex.dispatcher.waiters: a change wakes only the long polls that wait for it."""
import asyncio
import threading

from dpex.dispatcher.state import Changes
from dpex.dispatcher.waiters import Waiters


def woken(polls):
    return [p.future.done() for p in polls]


def test_a_change_wakes_the_polls_it_touches_and_new_splits_the_longest_waiting_hungry_workers():
    async def scenario():
        waiters = Waiters()
        a, b, c = (waiters.worker(w, wants_splits=True) for w in "abc")
        idle = waiters.worker("d", wants_splits=False)
        sync = waiters.consumer((1, 0))
        assert waiters.polling == 5 and not waiters.full
        waiters.wake(Changes(workers={"d"}))
        waiters.wake(Changes(consumers={(1, 1)}))
        assert woken([a, b, c, idle, sync]) == [False, False, False, True, False]
        waiters.wake(Changes(splits_freed=2))
        assert woken([a, b, c]) == [True, True, False]  # the two longest waiting
        waiters.wake(Changes(splits_freed=1, consumers={(1, 0)}))
        assert woken([c, sync]) == [True, True]  # a and b were moved to the back when woken
        for poll in (a, b, c, idle, sync):
            waiters.done(poll)
        assert waiters.polling == 0
    asyncio.run(scenario())


def test_a_poll_times_out_and_is_woken_from_another_thread():
    async def scenario():
        waiters = Waiters()
        poll = waiters.worker("a", wants_splits=False)
        await poll.wait(0.01)  # nothing wakes it: its timeout ends the wait
        waiters.done(poll)
        poll = waiters.worker("a", wants_splits=False)
        thread = threading.Thread(target=waiters.wake_all)
        thread.start()
        await asyncio.wait_for(poll.wait(60), 30)
        thread.join()
        assert poll.future.done()
    asyncio.run(scenario())
