"""dpex.dispatcher.status: what `dpex status` and the metrics show, counted
from the state: workers by state, each job's splits and consumers, and the
workers the trainers' measured rates call for."""
import asyncio

from dpex.proto import dispatcher_pb2 as dpb
from dpex.version import versions
from tests.unit.dispatching import LOCAL, heartbeat, job, plan, job_key, worker_key


def test_workers_jobs_and_what_the_trainers_need(make_core):
    core = make_core()
    a = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.2:1"), LOCAL).worker_id
    b = core.register_worker(dpb.RegisterWorkerRequest(versions=versions(), address="10.0.0.3:1"), LOCAL).worker_id
    core.deregister_worker(dpb.DeregisterWorkerRequest(worker_id=b, worker_key=worker_key(core, b)), LOCAL)
    job_id = job(core, "seen", consumers=2)
    plan(core, job_id, 7)  # 4 splits of 2
    assert len(heartbeat(core, a, want=1).splits) == 1
    status = core.status()
    assert [(w.worker_id, w.state, w.splits_held) for w in status.workers] == [(a, "alive", 1), (b, "left", 0)]
    (j,) = status.jobs
    assert (j.name, j.num_consumers, j.batches_planned, j.splits_assigned, j.splits_unassigned) == ("seen", 2, 7, 1, 3)
    assert (j.state, j.consumers_active, list(j.epochs), status.workers_needed) == ("running", 1, [0], 0)
    assert status.worker_heartbeats_total == 1 and status.splits_assigned_total == 1
    asyncio.run(core.sync_consumer(dpb.SyncConsumerRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, client_id=1,
                                                           workers_needed=3), LOCAL))
    status = core.status()
    assert status.jobs[0].workers_needed == 3 and status.workers_needed == 3  # 1 alive + 2 more


def test_each_job_says_whether_it_shares_and_why_not(make_core):
    core = make_core()

    def made(name, content=b"code", **settings):
        return core.get_or_create_job(dpb.GetOrCreateJobRequest(job=dpb.JobDef(
            name=name, dataset=b"spec-" + name.encode(), content=content, num_consumers=1,
            **{"batch_size": 4, **settings})), LOCAL).job_id

    def planned(job_id, seed=3, streams=0):
        request = dpb.SubmitPlanRequest(job_id=job_id, job_key=job_key(core, job_id), epoch=0, base_seed=seed, client_id=job_id % 1000 + 1,
                                        num_streams=streams)
        if not streams:
            request.batches.extend(dpb.IndexBatch(indices=[i]) for i in range(4))
        core.submit_plan(request, LOCAL)

    for name in ("a", "b"):  # a sweep's two trials: the same content, pickled apart, one seed
        planned(made(name))
    planned(made("seeded"), seed=4)
    planned(made("eights", batch_size=8))
    planned(made("opted_out", no_share=True))
    planned(made("drawn", process_seeds=True))
    planned(made("streams", content=b"other"), streams=2)
    core.release_consumer(dpb.ReleaseConsumerRequest(job_id=made("a"), job_key=job_key(core, made("a")), client_id=made("a") % 1000 + 1), LOCAL)
    why = {j.name: j.sharing for j in core.status().jobs}
    assert why == {
        "a": "with 1 job", "b": "with 1 job",  # a closed job's last plan still counts
        "seeded": "none: 2 jobs of its definition plan other batches (another seed, epoch or sampler)",
        "eights": "none: job a differs in batch_size",
        "opted_out": "off: share=False",
        "drawn": "off: reproducible=False (a sample's draws follow the process that makes it)",
        "streams": "off: an IterableDataset's streams are not shared"}
