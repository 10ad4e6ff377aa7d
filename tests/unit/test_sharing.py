"""dpex.worker.sharing: a batch of equal content is made once; each job
gets it under its own header; what is kept stays within its byte budget and
goes once every job that wanted it had it; failures are never shared; and
the definition digest counts what a batch holds, nothing else."""
from dpex import shm
from dpex.plan.spec import share_digest
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import worker_pb2 as wpb
from dpex.wire import build_frame, parse_frame
from dpex.wire.batchkey import Key
from dpex.worker.runtime import Task
from dpex.worker.sharing import Shared, content_key


def frame(key, payload=b"x" * 100, error=False):
    meta = wpb.Batch(job_id=key.job_id, consumer_index=key.consumer_index, epoch=key.epoch, seq=key.seq,
                     dataset_length=96)
    if error:
        meta.error.message = "boom"
        return build_frame(meta)
    return build_frame(meta, payload)


def shared(max_bytes=1 << 20):
    return Shared(max_bytes, lambda parts: b"".join(bytes(p) for p in parts))


A, B, C = (Key(epoch=0, seq=3, consumer_index=0, job_id=j) for j in (1, 2, 3))


def test_a_batch_made_for_one_job_is_each_other_jobs_under_its_own_header():
    s = shared()
    assert s.take(b"k", B) is None and s.follow(b"k", B) is None
    s.lead(b"k")
    follower = s.follow(b"k", B)
    s.made(b"k", frame(A), wanted={2, 3})
    for key, got in ((B, follower.result()), (C, s.take(b"k", C))):
        meta, payload = parse_frame(got)
        assert (meta.job_id, meta.seq, meta.dataset_length, bytes(payload)) == (key.job_id, 3, 96, b"x" * 100)
    assert (s.hits, s.misses, s.bytes) == (2, 1, 0)  # B and C had it: nothing kept


def test_what_is_kept_stays_within_the_budget_oldest_evicted_first():
    size = len(frame(A))
    s = shared(max_bytes=2 * size)
    for ck in (b"1", b"2", b"3"):
        s.lead(ck)
        s.made(ck, frame(A), wanted={2})
        assert s.bytes <= 2 * size
    assert s.take(b"1", B) is None and s.take(b"2", B) is not None and s.take(b"3", B) is not None
    s.lead(b"big")
    s.made(b"big", frame(A, payload=b"y" * 3 * size), wanted={2})  # larger than the budget: not kept
    assert s.take(b"big", B) is None and s.bytes == 0


def test_a_job_gone_takes_nothing_and_what_was_kept_for_it_alone_goes():
    s = shared()
    s.lead(b"k")
    s.made(b"k", frame(A), wanted={2})
    s.forget_job(2)
    assert s.bytes == 0 and s.take(b"k", B) is None


def test_a_failed_batch_is_not_shared_its_followers_make_it_themselves():
    s = shared()
    s.lead(b"k")
    follower = s.follow(b"k", B)
    s.made(b"k", frame(A, error=True), wanted={2})
    assert follower.result() is None and s.take(b"k", B) is None and s.hits == 0


def test_a_hand_off_file_is_copied_before_its_own_trainer_takes_it(tmp_path):
    path = tmp_path / "f"
    data = frame(A)
    path.write_bytes(data)
    s = shared()
    s.lead(b"k")
    s.made(b"k", shm.Handoff(str(path), len(data), b""), wanted={2})
    path.unlink()  # A's trainer took it
    assert parse_frame(s.take(b"k", B))[0].job_id == 2


def test_equal_content_has_one_key_and_any_difference_another():
    task = Task(Key(2, 5, 0, 1), "", [4, 9], base_seed=11, places=[4, 9])
    same = task._replace(key=Key(2, 7, 1, 2), job_path="elsewhere")  # another job's consumer and batch
    assert content_key(b"d", task) == content_key(b"d", same)
    for other in (task._replace(indices=[4, 8]), task._replace(places=[5, 9]), task._replace(base_seed=12),
                  task._replace(key=task.key._replace(epoch=3)), task._replace(whole=True)):
        assert content_key(b"d", other) != content_key(b"d", task)
    assert content_key(b"e", task) != content_key(b"d", task)


def test_the_definition_digest_counts_what_a_batch_holds_and_nothing_else():
    job = dpb.JobDef(name="trial-1", dataset=b"spec", num_consumers=1, batch_size=4)
    renamed = dpb.JobDef(name="trial-2", dataset=b"spec", num_consumers=2, batch_size=4, out_of_order=True)
    assert share_digest(job) == share_digest(renamed) is not None
    assert share_digest(dpb.JobDef(dataset=b"spec", batch_size=5)) != share_digest(job)
    assert share_digest(dpb.JobDef(dataset=b"other", batch_size=4)) != share_digest(job)
    assert share_digest(dpb.JobDef(dataset=b"spec", batch_size=4, no_share=True)) is None  # share=False
    assert share_digest(dpb.JobDef(dataset=b"spec", batch_size=4, process_seeds=True)) is None


def test_a_batch_no_other_job_wants_is_not_read_back(monkeypatch):
    """A lone job's hand-off file stays unread by the daemon: copying a batch's
    bytes for nobody was half the daemon's CPU per batch (worker_rate.py)."""
    s = shared()
    monkeypatch.setattr(Shared, "_keep", staticmethod(lambda frame: (_ for _ in ()).throw(AssertionError("read"))))
    s.lead(b"k")
    s.made(b"k", shm.Handoff("/nonexistent", 10, b""), wanted=set())
    assert (s.hits, s.misses, s.bytes) == (0, 1, 0)
