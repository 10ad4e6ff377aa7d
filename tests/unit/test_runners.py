"""The split runners' one contract, run against both runners (a map split
made by the pool, an IterableDataset stream made in its own process), each
behind the scheduler as the worker uses them: in the style of torchdata's
shared save/load test helper, one set of tests, one fixture per kind."""
from dataclasses import dataclass
from pathlib import Path

import pytest

from dpex.proto import dispatcher_pb2 as dpb
from dpex.testing import wait_until
from dpex.wire import decode, parse_frame
from dpex.wire.batchkey import Key
from dpex.worker.runners import MapRunner, StreamRunner
from dpex.worker.scheduler import Scheduler
from tests.unit.batches import job_file

N = 6  # batches in the split


@dataclass
class Case:
    scheduler: Scheduler
    split: dpb.Split
    gate: Path            # the dataset makes nothing until it exists
    runner: type
    pooled_batches: int   # what the split keeps of the worker's capacity while unmade

    def key(self, seq: int) -> Key:
        return Key(epoch=0, seq=seq, consumer_index=0, job_id=self.split.job_id)

    def values(self, frame) -> list[int]:
        meta, payload = parse_frame(frame)
        assert not meta.error.message and not meta.not_assigned and not meta.end_of_stream, meta
        batch = decode(payload)
        return (batch["y"] if "y" in batch else batch["i"]).tolist()


@pytest.fixture(params=["map", "stream"])
def case(request, pool, tmp_path):
    gate = tmp_path / "gate"
    if request.param == "map":  # batch i is samples 2i, 2i+1
        path = job_file(tmp_path, "Gated", batch_size=2, n=2 * N, path=str(gate))
        split = dpb.Split(split_id=1, job_id=9, consumer_index=0, epoch=0, first_seq=0,
                          batches=[dpb.IndexBatch(indices=[2 * i, 2 * i + 1]) for i in range(N)])
        kind, pooled = MapRunner, N
    else:  # stream 0 of 1: batch j is items 2j, 2j+1
        path = job_file(tmp_path, "GatedCounting", batch_size=2, n=2 * N, path=str(gate))
        split = dpb.Split(split_id=1, job_id=9, consumer_index=0, epoch=0, first_seq=0, num_streams=1)
        kind, pooled = StreamRunner, 0
    s = Scheduler(pool, lambda job_id: path, buffer_batches=8, max_inflight=2, worker_address="test-worker")
    yield Case(s, split, gate, kind, pooled)
    gate.touch()
    s.close()


def test_each_batch_asked_for_is_answered_with_that_batch(case):
    case.scheduler.add_split(case.split)
    assert isinstance(case.scheduler._held.get(1), case.runner)
    got: dict[int, list] = {}
    for seq in reversed(range(N)):  # asked out of order: each gets its own
        case.scheduler.request(case.key(seq), lambda frame, seq=seq: got.setdefault(seq, case.values(frame)))
    case.gate.touch()
    wait_until(lambda: len(got) == N, what="every batch")
    assert got == {j: [2 * j, 2 * j + 1] for j in range(N)}


def test_a_request_that_came_before_its_split_is_answered_once_it_comes(case):
    got = []
    case.scheduler.request(case.key(1), got.append)
    case.gate.touch()
    case.scheduler.add_split(case.split)
    wait_until(lambda: got, what="batch 1")
    assert case.values(got[0]) == [2, 3]


def test_a_released_split_tells_its_waiting_requests_it_is_not_here(case):
    case.scheduler.add_split(case.split)
    got = []
    case.scheduler.request(case.key(2), got.append)
    case.scheduler.release([1])
    wait_until(lambda: got, what="the answer to a released split's request")
    meta, _ = parse_frame(got[0])
    assert meta.not_assigned and meta.seq == 2
    assert case.scheduler.held_split_ids() == []


def test_a_cancelled_request_gets_nothing(case):
    case.scheduler.add_split(case.split)
    gone, kept = [], []
    case.scheduler.request(case.key(0), gone.append)
    case.scheduler.request(case.key(0), kept.append)
    case.scheduler.cancel(gone.append)
    case.gate.touch()
    wait_until(lambda: kept, what="batch 0 for the request that stayed")
    case.scheduler.request(case.key(1), kept.append)  # and the batch after: the one cancelled got nothing meanwhile
    wait_until(lambda: len(kept) == 2, what="batch 1")
    assert gone == [] and case.values(kept[0]) == [0, 1]


def test_what_a_held_split_keeps_of_the_pools_capacity(case):
    case.scheduler.add_split(case.split)
    # A map split with batches left counts as one busy split; a stream runs in
    # its own process and keeps none. Its consumer is not saturated yet either way.
    expected = 3 if case.pooled_batches else 4
    assert case.scheduler.free_capacity(4, record=False) == (expected, [])
    assert case.scheduler._held.get(1).unproduced() == case.pooled_batches


@pytest.mark.parametrize("streams", [0, 2], ids=["map split", "stream"])
def test_a_split_released_after_its_successor_came_leaves_the_successor_found(streams):
    """An epoch begun again: the new plan's split (the same batch keys) may reach the worker before the
    old one's release; releasing the old one forgot the new one's keys, and the epoch stalled (issue 58)."""
    from types import SimpleNamespace

    from dpex.worker.runners import Held

    def runner(split_id):
        split = dpb.Split(split_id=split_id, job_id=9, consumer_index=0, epoch=0, first_seq=1 if streams else 0,
                          num_streams=streams)
        keys = [] if streams else [Key(0, seq, 0, 9) for seq in range(4)]
        return SimpleNamespace(split=split, keys=keys, pooled=not streams)
    held = Held()
    old, new = runner(1), runner(2)
    held.add(old)
    held.add(new)
    assert held.pop(1) is old
    key = Key(0, 3, 0, 9)  # stream 1 of 2, or a map split's batch 3
    assert held.find(key) is new and held.holds(new) and not held.holds(old)
    assert held.pop(2) is new and held.find(key) is None


@pytest.mark.parametrize("streams", [0, 2], ids=["map split", "stream"])
def test_a_request_of_another_attempt_is_never_the_held_splits_of_the_same_keys(streams):
    """The same loader's epoch begun again: the new plan's requests name its attempt, and a split of the
    left plan (the same batch numbers, maybe other batches) held here does not answer them (issue 58)."""
    from types import SimpleNamespace

    from dpex.worker.runners import Held, split_keys
    split = dpb.Split(split_id=1, job_id=9, consumer_index=0, epoch=0, first_seq=1 if streams else 0,
                      num_streams=streams, num_batches=0 if streams else 4, attempt=5)
    old = SimpleNamespace(split=split, keys=[] if streams else split_keys(split), pooled=not streams)
    held = Held()
    held.add(old)
    assert held.find(Key(0, 3, 0, 9, 5)) is old
    assert held.find(Key(0, 3, 0, 9, 6)) is None  # waits for its own split, or is told it is not here
