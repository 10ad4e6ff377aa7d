"""dpex.dispatcher.assignment: who gets which split. Lowest first, consumers
interleaved, jobs shared fairly, saturated consumers skipped, and a batch a
trainer waits for given to the least loaded worker."""
from dpex.dispatcher import assignment
from dpex.dispatcher.state import DispatcherState
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb
from tests.unit.test_state import assign, create_job, deliver, firsts, register, submit


def test_consumers_are_interleaved_so_ranks_advance_together():
    s = DispatcherState()
    register(s, "a"), create_job(s, consumers=2)
    submit(s, 6, consumer=0), submit(s, 6, consumer=1)
    assert firsts(s, assign(s, "a", 4)) == [(0, 0), (1, 0), (0, 2), (1, 2)]


def test_jobs_share_a_worker_fairly():
    s = DispatcherState()
    register(s, "a"), create_job(s, job_id=1), create_job(s, job_id=2)
    submit(s, 8, job_id=1), submit(s, 8, job_id=2)
    got = assign(s, "a", 4)
    assert sorted(s.splits[i].job_id for i in got) == [1, 1, 2, 2]


def test_a_worker_gets_no_splits_of_consumers_it_is_saturated_with():
    s = DispatcherState()
    register(s, "a"), create_job(s, job_id=7), create_job(s, job_id=8)
    submit(s, 6, job_id=7), submit(s, 6, job_id=8)
    chosen = assignment.choose_splits(s, "a", 4, saturated=frozenset({(7, 0)}))  # job 7's trainer is slow
    assert {s.plan_of(i).job_id for i in chosen} == {8} and len(chosen) == 3


def test_a_waited_batch_nobody_holds_goes_to_the_least_loaded_worker():
    s = DispatcherState()
    register(s, "a"), register(s, "b"), create_job(s)
    plan = submit(s, 10, split=2)
    assign(s, "a", 2)  # splits of seqs 0-1 and 2-3
    assert assignment.owner_for(s, plan, 1) is None  # held already
    worker_id, split_id = assignment.owner_for(s, plan, 8)
    assert worker_id == "b" and s.plan_of(split_id) is plan and plan.first_seq(split_id - plan.first_split_id) == 8
    deliver(s, [0, 1])
    assert assignment.owner_for(s, plan, 0) is None  # delivered: nothing to make
    assert assignment.owner_for(s, plan, 99) is None  # past the plan
    assert assignment.least_loaded_worker(s).worker_id == "b"


def test_a_worker_that_is_gone_or_wants_nothing_gets_nothing():
    s = DispatcherState()
    register(s, "a"), create_job(s)
    submit(s, 4)
    assert assignment.choose_splits(s, "a", 0) == [] and assignment.choose_splits(s, "nobody", 3) == []


def test_the_same_split_of_plans_that_share_their_batches_goes_to_one_worker():
    s = DispatcherState()
    register(s, "a"), register(s, "b")
    for job_id, key in ((1, b"same"), (2, b"same"), (3, b"")):
        create_job(s, job_id=job_id)
        s.apply(jpb.Update(submit_plan=jpb.SubmitPlan(
            job_id=job_id, consumer_index=0, epoch=0, plan_hash=b"h%d" % job_id, split_size=2,
            batches=[dpb.IndexBatch(indices=[i]) for i in range(8)], share_key=key)))
    mine = assign(s, "a", 1)
    assert sorted((s.splits[i].job_id, s.splits[i].first_seq) for i in mine) == [(1, 0), (2, 0)]
    theirs = assign(s, "b", 3)  # job 3 shares nothing: its own split, and the pair's next
    assert sorted((s.splits[i].job_id, s.splits[i].first_seq) for i in theirs) == [(1, 2), (2, 2), (3, 0)]


def test_a_worker_of_another_torch_gets_no_split_of_a_sampler_described_with_this_one():
    # A worker with torch 2.12 registered as alive and failed every epoch whose sampler the
    # trainer described with torch 2.13 (issue 61): its splits now go to workers that can make them.
    s = DispatcherState()
    for worker_id, torch in (("old", "2.12.0"), ("new", "2.13.0")):
        s.apply(jpb.Update(register_worker=jpb.RegisterWorker(
            worker_id=worker_id, address=f"h:{worker_id}", versions=dpb.Versions(protocol=1, torch=torch))))
    create_job(s)
    s.apply(jpb.Update(submit_plan=jpb.SubmitPlan(
        job_id=7, consumer_index=0, epoch=0, plan_hash=b"h", split_size=2, num_batches=6,
        sampler=dpb.SamplerSpec(torch_version="2.13.0", length=6, batch_size=1))))
    assert assign(s, "old", 4) == [] and len(assign(s, "new", 4)) == 3
    submit(s, 6, epoch=1)  # explicit batches: any torch makes them
    assert len(assign(s, "old", 4)) == 3
