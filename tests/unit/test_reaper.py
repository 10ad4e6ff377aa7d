"""dpex.dispatcher.reaper on a fake clock: a silent consumer's plan is
released, a lost worker is forgotten and an idle job collected after their
timeouts (a trainer coming back is told what happened), and the thread
started by the server stops with it."""
import asyncio
import threading

import pytest

from dpex.dispatcher.reaper import Reaper
from dpex.errors import JOB_COLLECTED, DpexNotFoundError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.version import versions
from tests.unit.dispatching import LOCAL, Clock, heartbeat, job, plan, job_key


def test_silence_and_idleness_are_collected_after_their_timeouts(make_core):
    clock = Clock()
    core = make_core(clock, heartbeat_timeout_s=20.0, consumer_timeout_s=30.0, worker_gc_timeout_s=60.0, job_gc_timeout_s=100.0)
    reaper = Reaper(core)
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id
    job_id = job(core)
    plan(core, job_id, 4)
    assert heartbeat(core, worker).splits
    clock.now += 10
    reaper.reap()
    assert core.status().jobs[0].state == "running" and core.status().workers[0].state == "alive"
    clock.now += 25  # the consumer: 35 s silent; the worker: past its 20 s heartbeat timeout
    reaper.reap()
    status = core.status()
    assert status.jobs[0].state == "finished" and status.workers[0].state == "lost"
    # A trainer that was only stalled syncs again: told why its epoch is gone (not "another trainer").
    with pytest.raises(DpexNotFoundError, match=r"epoch 0 was released: its trainer had not synced for 30s "
                                                r"\(the dispatcher's --consumer-timeout\)"):
        asyncio.run(core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1), LOCAL))
    clock.now += 61
    reaper.reap()
    assert [w.worker_id for w in core.status().workers] == [] and len(core.status().jobs) == 1
    clock.now += 40  # the job: idle for more than 100 s
    reaper.reap()
    assert core.status().jobs == [] and core.status().jobs_collected_total == 1
    with pytest.raises(DpexNotFoundError, match=JOB_COLLECTED):
        core.get_job(dpb.GetJobRequest(job_id=job_id), LOCAL)


def test_the_thread_reaps_until_stopped(make_core):
    clock = Clock()
    core = make_core(clock)
    core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL)
    clock.now += 60  # past the 5 s heartbeat timeout
    reaper = Reaper(core).start()
    try:
        rounds = threading.Event()  # never set: a bounded wait between looks
        for _ in range(1000):  # its rounds are 50 ms apart (a fraction of the heartbeat interval)
            if core.status().workers[0].state == "lost":
                break
            rounds.wait(0.01)
        assert core.status().workers[0].state == "lost"
    finally:
        reaper.stop()
    assert not reaper._thread.is_alive()


def test_the_scaling_policy_looks_at_what_the_trainers_said_and_status_tells_why(make_core):
    import asyncio
    from dpex.cmd.status import render
    clock = Clock()
    core = make_core(clock, heartbeat_timeout_s=60.0, min_workers=1, max_workers=4, scale_cooldown_s=30.0)
    reaper = Reaper(core)
    core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL)
    job_id = job(core)
    plan(core, job_id, 8)
    reaper.reap()
    assert core.status().workers_wanted == 1
    asyncio.run(core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1, workers_needed=3,
                                                           wait_fraction=0.45, batches_per_s=20), LOCAL))
    reaper.reap()
    status = core.status()
    assert status.workers_wanted == 3 and "trainers wait 45% of the time; 1 -> 3" in status.scaling_reason
    assert "workers wanted: 3 (trainers wait 45%" in render(status)
    clock.now += 100  # the trainer went quiet: after the cool-down, back to the minimum
    reaper.reap()
    assert core.status().workers_wanted == 1


def test_a_dispatcher_without_max_workers_wants_nothing(make_core):
    core = make_core()
    Reaper(core).reap()
    assert core.status().workers_wanted == 0
