"""The dispatcher's pure state machine."""
import pytest

from dpex.dispatcher import assignment
from dpex.dispatcher.state import DispatcherState
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


def register(state, worker_id, address=None):
    state.apply(jpb.Update(register_worker=jpb.RegisterWorker(worker_id=worker_id,
                                                              address=address or f"h:{worker_id}")))


def create_job(state, job_id=7, consumers=1, name=""):
    state.apply(jpb.Update(create_job=jpb.CreateJob(
        job_id=job_id, job=dpb.JobDef(name=name, dataset=b"d", num_consumers=consumers))))


def submit(state, n, job_id=7, consumer=0, epoch=0, split=2, digest=b"h"):
    batches = [dpb.IndexBatch(indices=[i]) for i in range(n)]
    return state.apply(jpb.Update(submit_plan=jpb.SubmitPlan(
        job_id=job_id, consumer_index=consumer, epoch=epoch, batches=batches, plan_hash=digest,
        split_size=split)))


def assign(state, worker_id, n=1):
    chosen = assignment.choose_splits(state, worker_id, n)
    return state.apply(jpb.Update(assign_splits=jpb.AssignSplits(worker_id=worker_id, split_ids=chosen)))


def deliver(state, seqs, job_id=7, consumer=0, epoch=0):
    return state.apply(jpb.Update(mark_delivered=jpb.MarkDelivered(
        job_id=job_id, consumer_index=consumer, epoch=epoch, seqs=seqs)))


def firsts(state, split_ids):
    return [(state.splits[s].consumer_index, state.splits[s].first_seq) for s in split_ids]


def test_plan_is_cut_into_splits_and_assigned_lowest_first():
    s = DispatcherState()
    register(s, "a"), register(s, "b"), create_job(s)
    plan = submit(s, 7, split=2)
    assert plan.num_batches == 7 and len(plan.split_ids) == 4
    assert [plan.split_batches(i) for i in range(plan.num_splits)] == [2, 2, 2, 1]
    assert s.splits == {}  # made only when handed out
    assert firsts(s, assign(s, "a", 1)) == [(0, 0)]
    assert firsts(s, assign(s, "b", 2)) == [(0, 2), (0, 4)]
    assert firsts(s, assign(s, "a", 5)) == [(0, 6)]
    assert assign(s, "b", 1) == []


def test_delivery_completes_and_drops_splits():
    s = DispatcherState()
    register(s, "a"), create_job(s)
    plan = submit(s, 4)
    assign(s, "a", 2)
    assert deliver(s, [0, 0, 1, 99]) == 2  # duplicates and out-of-range seqs don't count
    assert plan.split_ids[0] not in s.splits and s.workers["a"].held == {plan.split_ids[1]}
    assert [o[0].first_seq for o in s.owners(plan)] == [2]
    assert s.releasable("a", plan.split_ids) == [plan.split_ids[0]]
    deliver(s, [2, 3])
    assert plan.num_delivered == 4 and s.owners(plan) == [] and s.jobs[7].batches_delivered == 4


def test_lost_worker_gives_back_undelivered_splits():
    s = DispatcherState()
    register(s, "a"), register(s, "b"), create_job(s)
    plan = submit(s, 6)
    assign(s, "a", 2)
    deliver(s, [0, 1, 2])  # split 0 done, split 1 half done
    s.apply(jpb.Update(worker_lost=jpb.WorkerLost(worker_id="a")))
    assert not s.workers["a"].alive and assign(s, "a") == []
    got = assign(s, "b", 3)
    assert firsts(s, got) == [(0, 2), (0, 4)]
    assert s.splits[got[0]].delivered == {2}  # what was delivered stays delivered
    assert len(s.owners(plan)) == 2


def test_restarted_worker_on_same_address_replaces_the_old_one():
    s = DispatcherState()
    register(s, "a", "h:1"), create_job(s)
    submit(s, 4)
    assign(s, "a", 2)
    register(s, "a2", "h:1")
    assert "a" not in s.workers and s.unassigned(7) == 2


def test_same_plan_again_keeps_progress_and_new_plan_replaces_it():
    s = DispatcherState()
    register(s, "a"), create_job(s)
    plan = submit(s, 4, digest=b"x")
    assign(s, "a", 1)
    deliver(s, [0])
    assert submit(s, 4, digest=b"x") is plan and plan.num_delivered == 1
    new = submit(s, 4, epoch=1, digest=b"y")
    assert not any(i in s.splits for i in plan.split_ids)
    assert s.workers["a"].held == set() and len(new.split_ids) == 2
    assert s.plan(7, 0, 0) is None and s.plan(7, 0, 1) is new


def test_release_consumer_cancels_its_plan():
    s = DispatcherState()
    register(s, "a"), create_job(s)
    plan = submit(s, 4)
    assign(s, "a", 1)
    s.apply(jpb.Update(release_consumer=jpb.ReleaseConsumer(job_id=7, consumer_index=0)))
    assert s.splits == {} and s.workers["a"].held == set() and s.plan(7, 0, 0) is None
    assert plan.split_ids


def test_named_jobs_are_found_by_name():
    s = DispatcherState()
    create_job(s, job_id=3, name="imagenet")
    assert s.find_job("imagenet").job_id == 3 and s.find_job("other") is None


class Recording(DispatcherState):
    """Keeps every update it applies, as the journal will."""

    def __init__(self):
        super().__init__()
        self.log = []

    def apply(self, update):
        self.log.append(update.SerializeToString())
        return super().apply(update)


def snapshot(st):
    return ({k: (v.alive, sorted(v.held)) for k, v in st.workers.items()},
            {k: (v.worker_id, sorted(v.delivered), v.first_seq) for k, v in st.splits.items()},
            {k: st.unassigned(k) for k in st.jobs}, st.next_split_id)


def test_replay_rebuilds_the_same_state():
    a = Recording()
    register(a, "w1"), register(a, "w2"), create_job(a, consumers=2)
    submit(a, 9, consumer=0), submit(a, 9, consumer=1)
    assign(a, "w1", 3), assign(a, "w2", 2)
    deliver(a, [0, 1, 2]), deliver(a, [0], consumer=1)
    a.apply(jpb.Update(worker_lost=jpb.WorkerLost(worker_id="w1")))
    assign(a, "w2", 4)
    b = DispatcherState()
    for raw in a.log:
        b.apply(jpb.Update.FromString(raw))
    assert snapshot(a) == snapshot(b)


def test_unknown_update_kind_is_rejected():
    with pytest.raises(ValueError):
        DispatcherState().apply(jpb.Update())


def test_releasing_one_epoch_leaves_a_newer_plan_alone():
    s = DispatcherState()
    register(s, "a"), create_job(s)
    submit(s, 4, epoch=0), submit(s, 4, epoch=1, digest=b"h1")
    s.apply(jpb.Update(release_consumer=jpb.ReleaseConsumer(job_id=7, consumer_index=0, epoch=0)))
    assert s.plan(7, 0, 1) is not None and s.unassigned(7) == 2  # epoch 1's splits stay
    s.apply(jpb.Update(release_consumer=jpb.ReleaseConsumer(job_id=7, consumer_index=0, epoch=1)))
    assert s.plan(7, 0, 1) is None and not s.splits


def test_a_removed_job_takes_its_splits_and_name_and_is_remembered():
    st = DispatcherState()
    register(st, "w1")
    create_job(st, job_id=7, name="abandoned")
    create_job(st, job_id=8)
    submit(st, 6, job_id=7)
    submit(st, 4, job_id=8)
    assign(st, "w1", n=2)
    st.apply(jpb.Update(remove_job=jpb.RemoveJob(job_id=7)))
    assert set(st.jobs) == {8} and st.find_job("abandoned") is None
    assert all(s.job_id == 8 for s in st.splits.values())
    assert all(st.splits[s].job_id == 8 for s in st.workers["w1"].held)  # its workers drop the rest
    assert st.collected == {7: "abandoned"} and st.jobs_collected_total == 1
    st.apply(jpb.Update(remove_job=jpb.RemoveJob(job_id=7)))  # again (a replay): nothing more
    assert st.jobs_collected_total == 1


def test_only_a_gone_worker_is_forgotten():
    st = DispatcherState()
    register(st, "w1")
    register(st, "w2")
    st.apply(jpb.Update(forget_worker=jpb.ForgetWorker(worker_id="w1")))
    assert set(st.workers) == {"w1", "w2"}  # alive: kept
    st.apply(jpb.Update(worker_lost=jpb.WorkerLost(worker_id="w1")))
    st.apply(jpb.Update(forget_worker=jpb.ForgetWorker(worker_id="w1")))
    assert set(st.workers) == {"w2"} and st.workers_forgotten_total == 1


def test_changes_name_only_what_an_update_touched():
    """The service wakes only the long polls that wait for what changed."""
    s = DispatcherState()
    register(s, "a"), register(s, "b"), create_job(s, consumers=2)
    s.take_changes()
    submit(s, 6)  # 3 splits
    c = s.take_changes()
    assert c.splits_freed == 3 and c.consumers == {(7, 0)} and not c.workers
    assign(s, "a", 2)
    c = s.take_changes()
    assert c.workers == {"a"} and c.consumers == {(7, 0)} and c.splits_freed == 0
    deliver(s, [0])  # half a split: nobody's splits change
    c = s.take_changes()
    assert not c.workers and not c.plans_ended
    deliver(s, [1])  # the split is done: a drops it with its next answer, not woken for it
    c = s.take_changes()
    assert not c.workers and set(c.settled) == {"a"} and len(c.settled["a"]) == 1
    assert not c.settled["a"] & s.workers["a"].held  # no longer a's
    s.apply(jpb.Update(worker_lost=jpb.WorkerLost(worker_id="a")))
    c = s.take_changes()
    assert c.workers == {"a"} and c.splits_freed == 1  # its other split is free again
    assign(s, "b", 2), deliver(s, [2, 3, 4, 5])
    assert s.take_changes().plans_ended == 1


def test_a_resumed_plan_hands_out_only_what_was_not_delivered_before_its_checkpoint():
    s = DispatcherState()
    register(s, "a"), create_job(s)
    plan = s.apply(jpb.Update(submit_plan=jpb.SubmitPlan(
        job_id=7, consumer_index=0, epoch=3, plan_hash=b"r", split_size=2, num_batches=9,
        sampler=dpb.SamplerSpec(length=9, batch_size=1),
        done=[dpb.SeqRange(start=0, end=3),
              dpb.SeqRange(start=6, end=8)])))
    # splits: [0,1] done, [2,3] half (2 done), [4,5], [6,7] done, [8]
    assert plan.done == 2 and plan.unassigned() == 3
    ids = assignment.choose_splits(s, "a", 5)
    s.apply(jpb.Update(assign_splits=jpb.AssignSplits(worker_id="a", split_ids=ids)))
    assert [(s.splits[i].first_seq, sorted(s.splits[i].delivered)) for i in ids] == [(2, [2]), (4, []), (8, [])]
    deliver(s, [3, 4, 5, 8], epoch=3)
    assert plan.finished
