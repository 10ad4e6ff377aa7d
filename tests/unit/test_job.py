"""dpex.client.job: a loader's job definition (its code pickled for the
workers, the same settings bytes in every rank), its DDP name, and the
plan upload in chunks, riding out a consumer held by a silent loader."""
import threading
import warnings

import pytest

from dpex.client import job as jobs
from dpex.client.distributed import Run
from dpex.client.options import LoaderOptions
from dpex.dataset import Constant, DatasetSpec
from dpex.errors import CONSUMER_IN_USE, DpexConfigError, DpexConflictError, DpexNotFoundError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.wire import callables

SPEC = DatasetSpec("dpex.client.sampling:Indices", 10)


def double(x):
    return 2 * x


def test_a_spec_and_its_functions_go_as_separate_pickles():
    fields = jobs.code_fields(SPEC, double, None, bundled=False)
    assert callables.loads(fields["dataset"]).target == SPEC.target
    assert callables.loads(fields["collate"])(3) == 6 and fields["worker_init_fn"] == b""


def test_an_instance_goes_with_its_functions_in_one_pickle_and_digests_name_them():
    fields = jobs.code_fields(DatasetSpec(Constant([1, 2])), double, None, bundled=True)
    spec, collate, init = callables.loads(fields["dataset"])
    assert spec.build() == [1, 2] and collate(2) == 4 and init is None
    assert fields["bundled"] and len(fields["collate"]) == 32 and fields["worker_init_fn"] == b""
    assert fields == jobs.code_fields(DatasetSpec(Constant([1, 2])), double, None, bundled=True)


def test_what_cannot_travel_is_refused_with_the_reason():
    with pytest.raises(DpexConfigError, match="collate_fn cannot be shipped.*Lock"):
        jobs.code_fields(SPEC, threading.Lock(), None, bundled=False)


def test_the_definition_leaves_the_code_out_so_ranks_agree():
    opts = LoaderOptions(batch_size=4, num_consumers=2)
    a = jobs.job_def(opts, (SPEC, double, None), bundled=False, unbatched=False)
    b = jobs.job_def(opts, (DatasetSpec("dpex.client.sampling:Indices", 10), lambda x: x, None), bundled=False,
                     unbatched=False)
    assert a.collate != b.collate and jobs.definition(a) == jobs.definition(b)
    assert (a.batch_size, a.num_consumers, a.process_seeds, a.main_process) == (4, 2, False, False)


def test_a_large_instance_is_worth_a_warning():
    with pytest.warns(UserWarning, match="pickles to 5.0 MB"):
        jobs.job_def(LoaderOptions(), (DatasetSpec(Constant(b"x" * (5 << 20))), None, None), bundled=True,
                     unbatched=False)


def test_ranks_of_one_run_share_one_name_and_outside_a_run_a_warning():
    job = jobs.job_def(LoaderOptions(num_consumers=2), (SPEC, None, None), bundled=False, unbatched=False)
    other = dpb.JobDef()
    other.CopyFrom(job)
    run = Run(0, 2, "run-a")
    assert jobs.name_shared(job, run) and jobs.name_shared(other, Run(1, 2, "run-a"))
    # The same name in each rank (here both in one process, so the second is this definition's next loader).
    assert job.name.endswith("-0") and other.name == job.name[:-1] + "1"
    with pytest.warns(UserWarning, match="without job_name and outside torch.distributed"):
        lone = dpb.JobDef(num_consumers=2)
        assert not jobs.name_shared(lone, None) and not lone.name
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not jobs.name_shared(dpb.JobDef(name="mine", num_consumers=2), run)


class FakeStub:
    SubmitPlan, GetOrCreateJob = "SubmitPlan", "GetOrCreateJob"


def test_an_explicit_plan_goes_in_chunks_and_starts_again_after_a_dispatcher_restart():
    calls, restarted = [], []

    def call(method, request):
        calls.append((request.upload_id, request.chunk, request.more, len(request.batches)))
        if request.chunk == 1 and not restarted:
            restarted.append(True)
            raise DpexNotFoundError("unknown plan upload 7")
        return dpb.SubmitPlanResponse(num_batches=3)
    batches = [dpb.IndexBatch(indices=list(range(200_000))) for _ in range(3)]
    assert jobs.submit(call, FakeStub, dpb.SubmitPlanRequest(job_id=1), batches) == 3
    first, second = calls[:2], calls[2:]
    assert [c[1] for c in first] == [0, 1] and [c[1] for c in second] == list(range(len(second)))
    assert len(second) > 1 and second[-1][2] is False and all(c[2] for c in second[:-1])
    assert first[0][0] != second[0][0]  # a new upload id
    assert sum(c[3] for c in second) == 3


def test_a_consumer_held_by_a_silent_loader_is_waited_for_and_a_live_one_is_not(monkeypatch):
    monkeypatch.setattr(jobs, "CLAIM_HELD_S", 0.5)
    monkeypatch.setattr(jobs.time, "sleep", lambda s: None)
    tries = []

    def held_twice(method, request):
        tries.append(1)
        if len(tries) <= 2:
            raise DpexConflictError(f"{CONSUMER_IN_USE} by another loader")
        return dpb.SubmitPlanResponse(num_batches=5)
    assert jobs.submit(held_twice, FakeStub, dpb.SubmitPlanRequest(num_streams=1), []) == 5 and len(tries) == 3

    def other_conflict(method, request):
        raise DpexConflictError("job 3 has other settings")
    with pytest.raises(DpexConflictError, match="other settings"):
        jobs.submit(other_conflict, FakeStub, dpb.SubmitPlanRequest(num_streams=1), [])


def test_another_lane_makes_an_unnamed_job_of_the_same_definition():
    seen = []

    def call(method, request):
        seen.append((request.job.name, request.settings_only))
        return dpb.GetOrCreateJobResponse(job_id=len(seen))
    request = dpb.GetOrCreateJobRequest(job=dpb.JobDef(name="shared", batch_size=2), settings_only=True)
    assert jobs.make(call, FakeStub, request, named=True) == (1, b"")
    assert jobs.make(call, FakeStub, request, named=False) == (2, b"")
    assert seen == [("shared", True), ("", False)] and request.job.name == "shared"
