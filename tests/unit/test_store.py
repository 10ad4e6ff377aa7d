"""Snapshot + log: a compaction keeps the state, bounds the disk, and survives a kill at any step."""
import asyncio
import os
import random
import threading

import pytest

from dpex.dispatcher import assignment, snapshot, store as store_mod
from dpex.dispatcher.state import DispatcherState
from dpex.dispatcher.store import Store
from dpex.errors import DpexError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


def history(epochs, rng=None):
    """Updates of a job with two consumers over ``epochs`` short epochs, a worker lost on the way."""
    rng = rng or random.Random(0)
    yield jpb.Update(register_worker=jpb.RegisterWorker(worker_id="w1", address="h:1"))
    yield jpb.Update(register_worker=jpb.RegisterWorker(worker_id="w2", address="h:2"))
    yield jpb.Update(create_job=jpb.CreateJob(job_id=5, job=dpb.JobDef(name="j", dataset=b"d", num_consumers=2)))
    split_id = 1
    for epoch in range(epochs):
        for consumer in range(2):
            yield jpb.Update(submit_plan=jpb.SubmitPlan(
                job_id=5, consumer_index=consumer, epoch=epoch, plan_hash=b"%d" % epoch, split_size=2,
                num_batches=6, sampler=dpb.SamplerSpec(length=60, batch_size=10, seed=epoch)))
        ids = list(range(split_id, split_id + 6))
        split_id += 6
        yield jpb.Update(assign_splits=jpb.AssignSplits(worker_id="w1", split_ids=ids[:3]))
        yield jpb.Update(assign_splits=jpb.AssignSplits(worker_id="w2", split_ids=ids[3:]))
        for consumer in range(2):
            seqs = list(range(6))
            rng.shuffle(seqs)
            for part in (seqs[:3], seqs[3:]):
                yield jpb.Update(mark_delivered=jpb.MarkDelivered(job_id=5, consumer_index=consumer,
                                                                  epoch=epoch, seqs=part))
    # the last epoch half done when w1 is lost
    yield jpb.Update(submit_plan=jpb.SubmitPlan(job_id=5, consumer_index=0, epoch=epochs, plan_hash=b"x",
                                                split_size=2, num_batches=6,
                                                sampler=dpb.SamplerSpec(length=60, batch_size=10)))
    yield jpb.Update(assign_splits=jpb.AssignSplits(worker_id="w1", split_ids=[split_id, split_id + 1]))
    yield jpb.Update(mark_delivered=jpb.MarkDelivered(job_id=5, consumer_index=0, epoch=epochs, seqs=[0, 2]))
    yield jpb.Update(worker_lost=jpb.WorkerLost(worker_id="w1"))


def same(a: DispatcherState, b: DispatcherState) -> bool:
    return snapshot.take(a) == snapshot.take(b)


def test_a_snapshot_restores_the_same_state_and_it_goes_on_the_same():
    live = DispatcherState()
    for u in history(3):
        live.apply(u)
    again = snapshot.restore(snapshot.take(live))
    assert same(live, again)
    more = jpb.Update(assign_splits=jpb.AssignSplits(worker_id="w2", split_ids=assignment.choose_splits(live, "w2", 3)))
    live.apply(more), again.apply(more)
    assert same(live, again) and live.workers["w2"].held == again.workers["w2"].held != set()


def disk(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run(path, epochs, compact_bytes=4096):
    s = Store(str(path), compact_bytes)
    state = s.recover()
    for u in history(epochs):
        s.append(u)
        state.apply(u)
        if s.due(state.take_changes().plans_ended > 0):
            s.compact(state)
    s.close()
    return state


@pytest.mark.parametrize("compact_bytes", [4096, 256 << 10])
def test_disk_and_restart_follow_the_live_state_not_the_history(tmp_path, compact_bytes):
    short, long = tmp_path / "short", tmp_path / "long"
    _, b = run(short, 10, compact_bytes), run(long, 1000, compact_bytes)
    # Between epochs the log holds at most half a snapshot, whatever the threshold.
    assert disk(long) <= 1.5 * disk(short)
    again = Store(str(long), 4096)
    assert same(again.recover(), b) and again.replayed < 200
    again.close()


@pytest.mark.parametrize("step", ["write", "rename", "new-log", "delete"])
def test_a_kill_at_any_step_of_a_compaction_loses_nothing(tmp_path, monkeypatch, step):
    s = Store(str(tmp_path), 0)
    state = s.recover()
    for u in history(4):
        s.append(u)
        state.apply(u)
    s.settle(s.appended)  # the store's own fsyncs done before fsync is made to fail

    class Killed(BaseException):
        pass

    def die(*a, **k):
        raise Killed

    target = {"write": (os, "fsync"), "rename": (os, "replace"), "new-log": (store_mod, "Journal"),
              "delete": (os, "unlink")}[step]
    with monkeypatch.context() as m:
        m.setattr(*target, die)  # "write": the fsync of snapshot.tmp, the compaction's first
        with pytest.raises(Killed):
            s.compact(state)
    s.close()  # its thread: what a kill ends (it wrote nothing since)
    recovered = Store(str(tmp_path), 0)
    assert same(recovered.recover(), state)
    tail = list(history(5))[-3:]  # and it takes more updates, durably
    for u in tail:
        recovered.append(u)
        state.apply(u)
    recovered.close()
    again = Store(str(tmp_path), 0)
    assert same(again.recover(), state)
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".log")) == [store_mod.log_name(again.generation)]
    again.close()


def test_appends_are_made_durable_in_groups_and_settle_waits_for_them(tmp_path, monkeypatch):
    s = Store(str(tmp_path), 0)
    state = s.recover()
    gate, syncing = threading.Event(), threading.Event()
    real = s.journal.sync

    def slow_sync():
        syncing.set()
        gate.wait()
        real()

    monkeypatch.setattr(s.journal, "sync", slow_sync)
    updates = list(history(3))
    first = s.append(updates[0])
    assert syncing.wait(10)  # the store's thread is in an fsync that covers the first record only
    positions = [s.append(u) for u in updates[1:]]
    settled = []
    waiter = threading.Thread(target=lambda: (s.settle(positions[-1]), settled.append(True)))
    waiter.start()
    waiter.join(0.2)
    assert not settled and s.durable < first  # nothing is durable while the fsync is held
    gate.set()
    waiter.join(10)
    assert settled and s.durable == s.appended == len(updates)
    assert s.syncs == 2  # the first record's fsync, then one for all the others
    for u in updates:
        state.apply(u)
    s.close()
    again = Store(str(tmp_path), 0)
    assert same(again.recover(), state)
    again.close()


def test_a_failed_fsync_fails_every_wait_and_says_why(tmp_path, monkeypatch):
    s = Store(str(tmp_path), 0)
    s.recover()

    def broken():
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(s.journal, "sync", broken)
    position = s.append(next(history(1)))
    with pytest.raises(DpexError, match="cannot make its journal .* durable .*Input/output error"):
        s.settle(position)
    with pytest.raises(DpexError, match="restarted"):
        asyncio.run(s.settled(position))
    s.close()
