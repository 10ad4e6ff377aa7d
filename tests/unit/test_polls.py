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


def test_a_gated_sync_waits_for_the_other_consumers_count_and_asks_it_to_tell_at_once(make_core):
    """even_batches: consumer 0 waits to give batch 3; consumer 1 told 2 and waits in its own long poll:
    it is answered at once, asked to tell again past 3 (report_past), and its next count answers 0."""
    core = make_core()
    job_id = job(core, "ddp", consumers=2)
    plan(core, job_id, 6, consumer=0, client=1)
    plan(core, job_id, 6, consumer=1, client=2)

    def sync(consumer, client, **kw):
        return core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0,
                                                          consumer_index=consumer, client_id=client, **kw), LOCAL)

    async def run():
        first = await sync(1, 2, ready=2)  # answered at once (no owners digest yet): it told 2
        idle = asyncio.ensure_future(sync(1, 2, ready=2, wait_s=30, owners_digest=first.owners_digest))
        assert not await settle(idle)
        gated = asyncio.ensure_future(sync(0, 1, ready=6, total=6, gate=3, even_batches="shortest", wait_s=30,
                                           owners_digest=first.owners_digest))
        asked = await asyncio.wait_for(idle, 10)  # woken: told to tell again once past 3
        assert asked.report_past == 3 and not await settle(gated)
        await sync(1, 2, ready=3, wait_s=0)  # not yet past it
        assert not await settle(gated)
        await sync(1, 2, ready=4, wait_s=0)
        answer = await asyncio.wait_for(gated, 10)
        return {c.consumer_index: (c.ready, c.total if c.HasField("total") else None) for c in answer.counts}
    assert asyncio.run(run()) == {0: (6, 6), 1: (4, None)}
