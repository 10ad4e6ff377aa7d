"""dpex.dispatcher.core in process, without gRPC or daemons: workers
register and take splits, trainers plan and sync, conflicts are refused,
silence is noticed on a fake clock, and a restart recovers from the journal."""
import asyncio

import pytest

from dpex.dispatcher.reaper import Reaper
from dpex.errors import DpexAuthError, DpexConfigError, DpexConflictError, DpexNotFoundError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.version import versions
from tests.unit.dispatching import LOCAL, Clock, heartbeat, job, plan, job_key


def test_a_planned_epoch_goes_in_splits_to_the_workers_that_ask_and_the_trainer_learns_their_owners(make_core):
    core = make_core()
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:7071"), LOCAL).worker_id
    job_id = job(core)
    assert plan(core, job_id, 5).num_batches == 5
    splits = heartbeat(core, worker).splits
    assert [(s.first_seq, s.num_batches) for s in splits] == [(0, 2), (2, 2), (4, 1)]
    assert [list(b.indices) for b in splits[1].batches] == [[2], [3]]
    sync = asyncio.run(core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1), LOCAL))
    assert {(o.first_seq, o.worker_address) for o in sync.owners} == {(0, "10.0.0.2:7071"), (2, "10.0.0.2:7071"),
                                                                       (4, "10.0.0.2:7071")}
    status = core.status()
    assert status.jobs[0].batches_planned == 5 and status.workers[0].splits_held == 3


def test_bad_and_conflicting_requests_are_refused_with_dpex_errors(make_core):
    core = make_core()
    with pytest.raises(DpexConfigError, match="HOST:PORT"):
        core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="nowhere"), LOCAL)
    with pytest.raises(DpexAuthError, match="loopback"):
        core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), "ipv4:10.0.0.9:5000")
    with pytest.raises(DpexNotFoundError, match="unknown worker"):
        heartbeat(core, "w-nobody")
    with pytest.raises(DpexNotFoundError, match="unknown job 99"):
        plan(core, 99, 1)
    named = job(core, "shared", consumers=2)
    assert job(core, "shared", consumers=2) == named
    with pytest.raises(DpexConflictError, match="num_consumers"):
        job(core, "shared", consumers=3)
    plan(core, named, 4, consumer=0, client=1)
    assert plan(core, named, 3, consumer=1, client=2).num_batches == 3  # torch's counts (dpex.plan.even warns)
    with pytest.raises(DpexConflictError, match="in use by another loader"):
        plan(core, named, 4, consumer=0, client=7)  # another loader on a busy consumer


def test_a_silent_worker_is_lost_and_its_splits_go_to_another_on_the_fake_clock(make_core):
    clock = Clock()
    core = make_core(clock)
    a = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id
    b = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.3:1"), LOCAL).worker_id
    plan(core, job(core), 4)
    taken = [s.split_id for s in heartbeat(core, a).splits]
    assert len(taken) == 2
    clock.now += 4
    heartbeat(core, b, want=0)
    Reaper(core).reap()
    assert [w.state for w in core.status().workers] == ["alive", "alive"]
    clock.now += 2  # a: 6 s silent, past its 5 s timeout; b: 2 s
    Reaper(core).reap()
    assert {w.worker_id: w.state for w in core.status().workers} == {a: "lost", b: "alive"}
    assert sorted(s.split_id for s in heartbeat(core, b).splits) == sorted(taken)


def test_a_restarted_dispatcher_recovers_workers_jobs_and_plans_from_its_journal(make_core, tmp_path):
    core = make_core(work_dir=str(tmp_path))
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id
    job_id = job(core, "kept")
    plan(core, job_id, 6)
    held = [s.split_id for s in heartbeat(core, worker).splits]
    core.store.settle(core.store.appended)
    core.close()
    again = make_core(work_dir=str(tmp_path))
    assert job(again, "kept") == job_id
    assert plan(again, job_id, 6).num_batches == 6  # the same plan again: a reconnect, nothing changes
    assert heartbeat(again, worker, held=held).splits == []  # it holds what it held
    assert again.status().jobs[0].splits_assigned == 3


def test_an_epoch_begun_again_is_a_plan_of_its_own_which_the_earlier_attempts_release_leaves(make_core, tmp_path):
    """The resume race (issue 58): the same loader's same epoch, begun again by a new iter(), is a new
    plan (not a reconnect that would carry the left iterator's deliveries), and the left iterator's
    release, arriving late, names its own attempt: it ends nothing, through a restart and a snapshot."""
    from dpex.dispatcher import snapshot
    core = make_core(work_dir=str(tmp_path))
    job_id = job(core, "again")
    key = job_key(core, job_id)
    plan(core, job_id, 6, attempt=1)
    first = core.state.jobs[job_id].plans[0]
    assert plan(core, job_id, 6, attempt=1).num_batches == 6  # the same iter()'s retry: a reconnect
    assert core.state.jobs[job_id].plans[0] is first
    plan(core, job_id, 6, attempt=2)
    second = core.state.jobs[job_id].plans[0]
    assert second is not first and second.attempt == 2

    def release(core, attempt):
        core.release_consumer(dpb.ReleaseConsumerRequest(job_id=job_id, job_key=key, consumer_index=0, client_id=1,
                                                         epoch=0, attempt=attempt), LOCAL)
    release(core, 1)
    assert core.state.jobs[job_id].plans[0] is second
    core.store.settle(core.store.appended)
    core.close()
    again = make_core(work_dir=str(tmp_path))
    assert again.state.jobs[job_id].plans[0].attempt == 2
    assert snapshot.restore(snapshot.take(again.state)).jobs[job_id].plans[0].attempt == 2
    release(again, 1)
    assert 0 in again.state.jobs[job_id].plans
    release(again, 2)
    assert 0 not in again.state.jobs[job_id].plans


def test_a_left_iterators_late_sync_marks_nothing_of_the_plan_that_replaced_it(make_core):
    """The resume race's fifth cause (issue 58): the left iterator's last sync (its acks, sent as it
    closed) reached the dispatcher after the same epoch's new plan and marked that plan's batches
    delivered, which its own iterator had not had: their split was done, with no owner to ask."""
    core = make_core()
    worker = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:7071"),
                                  LOCAL).worker_id
    job_id = job(core, "again")
    key = job_key(core, job_id)
    plan(core, job_id, 6, attempt=1)
    plan(core, job_id, 6, attempt=2)
    heartbeat(core, worker)

    def sync(attempt, seqs):
        return asyncio.run(core.sync_consumer(dpb.SyncConsumerRequest(
            job_id=job_id, job_key=key, epoch=0, client_id=1, attempt=attempt, delivered_seqs=seqs), LOCAL))
    assert not sync(1, [0, 1, 2, 3]).owners  # the left one's: nothing marked, no owners named
    assert core.state.jobs[job_id].plans[0].num_delivered == 0
    assert {o.first_seq for o in sync(2, [0]).owners} == {0, 2, 4}
    assert core.state.jobs[job_id].plans[0].num_delivered == 1


def test_a_worker_of_another_protocol_is_refused_naming_both_versions(make_core):
    core = make_core()
    other = dpb.Versions(dpex="0.0.9", protocol=0, torch="2.13.0", python="3.11.7")
    with pytest.raises(DpexConfigError, match=r"it is dpex 0\.0\.9 \(protocol 0, torch 2\.13\.0, Python 3\.11\.7\), "
                                              r"the dispatcher dpex .* \(protocol 2, "):
        core.register_worker(dpb.RegisterWorkerRequest(address="10.0.0.2:1", versions=other), LOCAL)
    worker = core.register_worker(dpb.RegisterWorkerRequest(address="10.0.0.2:1", versions=versions()), LOCAL)
    (seen,) = core.status().workers
    assert seen.worker_id == worker.worker_id and seen.versions == versions()
    assert core.status().versions == versions()


@pytest.mark.parametrize("host,token,level", [("0.0.0.0", None, "WARNING"), ("127.0.0.1", None, "INFO"),
                                              ("0.0.0.0", "s3cret", "INFO")])
def test_listening_beyond_loopback_without_a_token_is_a_warning(host, token, level, caplog):
    # "auth: none" on every interface was an INFO line among others (issue 61).
    import logging
    from dpex.config import DispatcherConfig
    from dpex.dispatcher.server import DispatcherServer
    caplog.set_level(logging.INFO, logger="dpex.dispatcher")
    server = DispatcherServer(DispatcherConfig(host=host, port=0, auth_token=token))
    try:
        (line,) = [r for r in caplog.records if r.getMessage().startswith("dispatcher listening on")]
        assert line.levelname == level and ("auth: NONE" in line.getMessage()) == (token is None)
    finally:
        server.close(0)


def test_calls_on_a_job_or_a_worker_without_its_key_are_refused_logged_and_counted(make_core, tmp_path, caplog):
    # Issue 61: any peer could read a job's definition, ack or release its epochs, and deregister workers.
    core = make_core(work_dir=str(tmp_path))
    registered = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:7071"),
                                      LOCAL)
    made = core.get_or_create_job(dpb.GetOrCreateJobRequest(job=dpb.JobDef(dataset=b"spec", num_consumers=1,
                                                                          batch_size=4)), LOCAL)
    assert made.job_key == job_key(core, made.job_id) and len(made.job_key) == 16
    plan(core, made.job_id, 4)
    stranger = "ipv4:127.0.0.1:50000"
    forged = [
        lambda: core.get_job(dpb.GetJobRequest(job_id=made.job_id), stranger),
        lambda: core.submit_plan(dpb.SubmitPlanRequest(job_id=made.job_id, job_key=b"x" * 16, epoch=1), stranger),
        lambda: asyncio.run(core.sync_consumer(dpb.SyncConsumerRequest(job_id=made.job_id, epoch=0,
                                                                       delivered_seqs=[0, 1, 2, 3]), stranger)),
        lambda: core.release_consumer(dpb.ReleaseConsumerRequest(job_id=made.job_id), stranger),
    ]
    for call in forged:
        with pytest.raises(DpexAuthError, match=f"names job {made.job_id} without its key"):
            call()
    for request in (dpb.DeregisterWorkerRequest(worker_id=registered.worker_id),
                    dpb.WorkerHeartbeatRequest(worker_id=registered.worker_id, worker_key=b"y" * 16)):
        with pytest.raises(DpexAuthError, match=f"names worker {registered.worker_id} without its key"):
            (core.deregister_worker(request, stranger) if isinstance(request, dpb.DeregisterWorkerRequest)
             else asyncio.run(core.worker_heartbeat(request, stranger)))
    status = core.status()
    assert dict(status.refused_calls_total) == {"job key": 4, "worker key": 2}
    assert status.jobs[0].batches_delivered == 0 and status.workers[0].state == "alive"  # nothing took effect
    assert f"refused a call from {stranger} (job key, 1 so far)" in caplog.text
    # The job's own key works, and the keys outlive a restart (the secret is in the work dir).
    assert core.get_job(dpb.GetJobRequest(job_id=made.job_id, job_key=made.job_key), LOCAL).job.batch_size == 4
    core.close()
    again = make_core(work_dir=str(tmp_path))
    assert again.get_job(dpb.GetJobRequest(job_id=made.job_id, job_key=made.job_key), LOCAL).job.batch_size == 4
    again.deregister_worker(dpb.DeregisterWorkerRequest(worker_id=registered.worker_id,
                                                        worker_key=registered.worker_key), LOCAL)
    assert again.status().workers[0].state == "left"


def test_without_a_token_every_call_from_beyond_loopback_is_refused(make_core):
    core = make_core()
    made = core.get_or_create_job(dpb.GetOrCreateJobRequest(job=dpb.JobDef(dataset=b"spec", num_consumers=1,
                                                                          batch_size=4)), LOCAL)
    remote = "ipv4:10.1.2.3:40000"
    for call in (lambda: core.get_status(dpb.GetStatusRequest(), remote),
                 lambda: core.get_job(dpb.GetJobRequest(job_id=made.job_id, job_key=made.job_key), remote),
                 lambda: core.report_worker(dpb.ReportWorkerRequest(address="10.0.0.2:7071"), remote),
                 lambda: core.release_consumer(dpb.ReleaseConsumerRequest(job_id=made.job_id,
                                                                          job_key=made.job_key), remote)):
        with pytest.raises(DpexAuthError, match="has no auth token, so it .* only from loopback peers"):
            call()
    assert dict(core.status().refused_calls_total) == {"not loopback": 4}
    assert make_core(auth_token="t").get_status(dpb.GetStatusRequest(), remote).uptime_s >= 0
