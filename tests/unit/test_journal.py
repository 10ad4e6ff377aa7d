"""The dispatcher journal: durable records, replay, a torn tail ignored and
kept aside, a corrupt record followed by good ones refused."""
import os

import pytest

from dpex.dispatcher.journal import FILE_NAME, Journal, read_records
from dpex.dispatcher.state import DispatcherState
from dpex.dispatcher.store import Store
from dpex.errors import DpexConfigError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb


def updates():
    yield jpb.Update(register_worker=jpb.RegisterWorker(worker_id="w1", address="h:1"))
    yield jpb.Update(create_job=jpb.CreateJob(job_id=5, job=dpb.JobDef(dataset=b"d", num_consumers=1)))
    yield jpb.Update(submit_plan=jpb.SubmitPlan(job_id=5, consumer_index=0, epoch=0, plan_hash=b"h",
                                                split_size=2, batches=[dpb.IndexBatch(indices=[i]) for i in range(6)]))
    yield jpb.Update(assign_splits=jpb.AssignSplits(worker_id="w1", split_ids=[1, 2]))
    yield jpb.Update(mark_delivered=jpb.MarkDelivered(job_id=5, consumer_index=0, epoch=0, seqs=[0, 1]))


def test_replay_rebuilds_the_state(tmp_path):
    journal = Journal(str(tmp_path))
    live = DispatcherState()
    for u in updates():
        journal.append(u)
        live.apply(u)
    journal.close()
    again = DispatcherState()
    for u in Journal(str(tmp_path)).replay():
        again.apply(u)
    assert set(again.splits) == set(live.splits) == {2}  # split 3 was never handed out
    assert again.workers["w1"].held == {2} and again.jobs[5].batches_delivered == 2


def written(tmp_path):
    """A journal holding updates(), closed; its path."""
    journal = Journal(str(tmp_path))
    for u in updates():
        journal.append(u)
    journal.close()
    return os.path.join(tmp_path, FILE_NAME)


def test_a_torn_tail_is_ignored_and_cut_off(tmp_path):
    path = written(tmp_path)
    whole = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x12\x34")  # a header cut short by a crash
    assert len(read_records(path)[0]) == 5
    reopened = Journal(str(tmp_path))
    assert os.path.getsize(path) == whole  # the torn bytes are gone
    assert len(list(reopened.replay())) == 5
    reopened.append(jpb.Update(worker_lost=jpb.WorkerLost(worker_id="w1")))
    reopened.close()
    assert len(read_records(path)[0]) == 6


def test_a_corrupt_last_record_ends_the_replay(tmp_path):
    path = written(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[-3] ^= 0xFF  # flip bits in the last record: its CRC no longer matches
    open(path, "wb").write(bytes(data))
    assert len(read_records(path)[0]) == 4


def test_an_empty_work_dir_starts_empty(tmp_path):
    assert list(Journal(str(tmp_path / "new")).replay()) == []


def test_a_bad_record_followed_by_good_ones_refuses_to_start_and_keeps_the_file(tmp_path):
    # One byte flipped at a quarter of the journal dropped every later record in
    # silence and cut them from the file (issue 61): corruption, not a torn tail.
    path = written(tmp_path)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 4] ^= 0x01
    open(path, "wb").write(bytes(data))
    with pytest.raises(DpexConfigError, match=r"is corrupt: the record at offset \d+ is bad and good records "
                                              r"follow it .* the file is kept as it is"):
        Journal(str(tmp_path))
    assert open(path, "rb").read() == bytes(data)
    with pytest.raises(DpexConfigError, match="is corrupt"):  # and through the store, as the dispatcher starts
        Store(str(tmp_path)).recover()


def test_a_torn_tail_is_kept_beside_the_journal(tmp_path):
    path = written(tmp_path)
    whole = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x12\x34" + bytes(100))  # a header cut short, then zeros a crash left
    Journal(str(tmp_path)).close()
    assert os.path.getsize(path) == whole
    assert open(f"{path}.torn-{whole}", "rb").read() == b"\x40\x00\x00\x00\x12\x34" + bytes(100)
