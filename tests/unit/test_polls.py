"""dpex.dispatcher.polls: the two long polls wake for what they wait for.
A heartbeat is answered at once for a split cancelled, not for one delivered
in full (it drops that with its next answer); a sync once its owners change;
both end when the dispatcher stops serving."""
import asyncio

import pytest

from dpex.errors import DpexConnectionError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.version import versions
from tests.unit.dispatching import LOCAL, heartbeat, job, plan, job_key, worker_key


async def settle(task, rounds=20):
    """Lets the loop run a few rounds: a woken poll would answer in them."""
    for _ in range(rounds):
        await asyncio.sleep(0)
    return task.done()


def test_a_heartbeat_waits_through_a_delivery_and_answers_a_cancel_at_once(make_core):
    core = make_core(heartbeat_interval_s=30.0, heartbeat_timeout_s=120.0)
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id
    job_id = job(core)
    plan(core, job_id, 4)
    held = [s.split_id for s in heartbeat(core, worker).splits]
    assert len(held) == 2

    async def run():
        task = asyncio.ensure_future(core.worker_heartbeat(dpb.WorkerHeartbeatRequest(
            worker_id=worker, worker_key=worker_key(core, worker), want_splits=0, held_split_ids=held), LOCAL))
        assert not await settle(task) and core.waiters.polling == 1
        await core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1,
                                                         delivered_seqs=[0, 1]), LOCAL)
        assert not await settle(task)  # delivered in full: no reason to answer now
        core.release_consumer(dpb.ReleaseConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), consumer_index=0, client_id=1), LOCAL)
        return await asyncio.wait_for(task, 10)
    response = asyncio.run(run())
    assert sorted(response.release_split_ids) == sorted(held) and not core.waiters.settled


def test_a_sync_answers_when_its_owners_change(make_core):
    core = make_core(heartbeat_interval_s=30.0, heartbeat_timeout_s=120.0)
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id
    job_id = job(core)
    plan(core, job_id, 4)

    async def run():
        first = await core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1), LOCAL)
        # The trainer waits for batch 0, so its split has an owner at once.
        assert [o.first_seq for o in first.owners] == [0]
        task = asyncio.ensure_future(core.sync_consumer(dpb.SyncConsumerRequest(
            job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1, wait_s=30, owners_digest=first.owners_digest), LOCAL))
        assert not await settle(task)
        await core.worker_heartbeat(dpb.WorkerHeartbeatRequest(worker_id=worker, worker_key=worker_key(core, worker), want_splits=4), LOCAL)
        return await asyncio.wait_for(task, 10)
    assert [o.first_seq for o in asyncio.run(run()).owners] == [0, 2]


def test_a_dispatcher_that_stops_serving_ends_its_long_polls_as_an_outage(make_core):
    core = make_core(heartbeat_interval_s=30.0, heartbeat_timeout_s=120.0)
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id

    async def run():
        task = asyncio.ensure_future(core.worker_heartbeat(dpb.WorkerHeartbeatRequest(
            worker_id=worker, worker_key=worker_key(core, worker), want_splits=4), LOCAL))
        assert not await settle(task)
        core.stop_serving()
        return await asyncio.wait_for(task, 10)
    with pytest.raises(DpexConnectionError, match="shutting down"):
        asyncio.run(run())
