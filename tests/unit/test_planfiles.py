"""Explicit plans on the dispatcher's disk: chunks appended as they come,
one split read back with two small reads, retries and restarts, and files
deleted once no plan names them."""
import os
import time

import pytest

from dpex.dispatcher.planfiles import PlanFiles
from dpex.errors import DpexConfigError, DpexNotFoundError
from dpex.plan.spec import PlanHash
from dpex.proto import dispatcher_pb2 as dpb

META = (1, 0, 3, 77)  # job, consumer, epoch, base seed


def batches(n: int, start: int = 0) -> list[dpb.IndexBatch]:
    """Batches of varied sizes; some are an unbatched job's elements, some carry places."""
    out = []
    for i in range(start, start + n):
        if i % 4 == 3:
            out.append(dpb.IndexBatch(indices=[i], whole=True, places=[1000 + i]))
        elif i % 4 == 2:
            out.append(dpb.IndexBatch(indices=list(range(i, i + i % 5 + 1)), places=list(range(i, i + i % 5 + 1))))
        else:
            out.append(dpb.IndexBatch(indices=[-i, i, 2**40 + i][: i % 3 + 1]))
    return out


def test_a_plan_sent_in_chunks_reads_back_split_by_split(tmp_path):
    files = PlanFiles(str(tmp_path))
    plan = batches(23)
    for chunk, at in enumerate(range(0, 23, 7)):
        files.add(5, chunk, plan[at:at + 7], split_size=4, meta=META)
    name, count, digest = files.finish(5)
    expected = PlanHash(META[3], 0)
    expected.update(plan)
    assert count == 23 and digest == expected.digest()
    assert sorted(os.listdir(tmp_path)) == [name, name + ".splits"]  # durable, no .tmp left
    for split in range(6):  # the last split holds 3
        got = files.read(name, split, min(4, 23 - 4 * split))
        assert got == plan[4 * split:4 * split + 4]


def test_a_retried_chunk_is_ignored_and_a_missing_one_is_asked_for_again(tmp_path):
    files = PlanFiles(str(tmp_path))
    plan = batches(6)
    files.add(9, 0, plan[:3], split_size=2, meta=META)
    files.add(9, 0, plan[:3], split_size=2, meta=META)  # its answer was lost: sent again
    with pytest.raises(DpexNotFoundError, match="no chunk 2 here.*from its first chunk"):
        files.add(9, 3, plan[3:], split_size=2, meta=META)
    with pytest.raises(DpexNotFoundError):
        files.add(10, 1, plan[3:], split_size=2, meta=META)  # never started (the dispatcher restarted)
    files.add(9, 1, plan[3:], split_size=2, meta=META)
    name, count, _ = files.finish(9)
    assert count == 6 and files.read(name, 2, 2) == plan[4:]


def test_bad_batches_are_refused(tmp_path):
    files = PlanFiles(str(tmp_path))
    with pytest.raises(DpexConfigError, match="2 places for 3 indices"):
        files.add(1, 0, [dpb.IndexBatch(indices=[1, 2, 3], places=[1, 2])], split_size=2, meta=META)


def test_an_upload_started_again_and_one_cut_short_by_a_crash_leave_no_file(tmp_path):
    files = PlanFiles(str(tmp_path))
    files.add(4, 0, batches(3), split_size=2, meta=META)
    files.add(4, 1, batches(3, 3), split_size=2, meta=META)
    files.add(4, 0, batches(2), split_size=2, meta=(1, 0, 4, 77))  # a new epoch's plan under the same id
    name, count, _ = files.finish(4)
    assert count == 2 and sorted(os.listdir(tmp_path)) == [name, name + ".splits"]
    files.add(6, 0, batches(3), split_size=2, meta=META)  # the dispatcher dies here
    assert any(e.endswith(".tmp") for e in os.listdir(tmp_path))
    PlanFiles(str(tmp_path))  # the next one starts
    assert sorted(os.listdir(tmp_path)) == [name, name + ".splits"]


def test_files_no_plan_names_are_deleted_once_old_and_an_unreadable_one_says_so(tmp_path):
    files = PlanFiles(str(tmp_path))
    names = []
    for upload in (1, 2, 3):
        files.add(upload, 0, batches(4), split_size=2, meta=(1, 0, upload, 7))
        names.append(files.finish(upload)[0])
    old = time.time() - 3600
    for entry in os.listdir(tmp_path):
        if not entry.startswith(names[2]):  # the third was just written: it may be about to be journaled
            os.utime(tmp_path / entry, (old, old))
    files.keep({names[0]})
    assert sorted(os.listdir(tmp_path)) == sorted([names[0], names[0] + ".splits", names[2], names[2] + ".splits"])
    os.unlink(tmp_path / (names[0] + ".splits"))
    with pytest.raises(DpexConfigError, match="unreadable.*submit the plan again"):
        files.read(names[0], 0, 2)
    files.close()
