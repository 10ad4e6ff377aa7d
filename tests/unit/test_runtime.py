"""Inside a batch process (dpex.worker.runtime), run in this process: a task
becomes one Batch frame as torch's worker makes a batch (torch is the
oracle), errors name their stage and sample, and keyed draws depend on a
sample's place alone."""
import pytest
import torch
from torch.utils.data import DataLoader, default_collate
from torch.utils.data._utils import worker as torch_worker

from dpex import seeding
from dpex.proto import worker_pb2 as wpb
from dpex.testing.datasets import Squares, WorkerProbe, record_worker_init
from dpex.wire import decode, parse_frame
from dpex.worker import runtime
from dpex.wire.batchkey import Key
from dpex.worker.runtime import Task, produce
from tests.unit.batches import job_file


@pytest.fixture(autouse=True)
def a_batch_process():
    """This process as a batch process for one test: its job cache, its
    worker info and its global generators are put back afterwards."""
    states, info = seeding.global_states(), torch_worker._worker_info
    old = runtime.use(runtime.BatchProcess("test-worker"))
    yield
    runtime.use(old)
    torch_worker._worker_info = info
    seeding.restore_global_states(states)


def batch_of(frame) -> tuple[wpb.Batch, object]:
    meta, payload = parse_frame(frame)
    return meta, (decode(payload) if not meta.error.type else None)


def test_a_task_is_torchs_collated_batch_in_a_frame(tmp_path):
    path = job_file(tmp_path, "Squares", n=20)
    meta, batch = batch_of(produce(Task(Key(3, 11, 2, 7), path, [5, 1, 19])))
    assert (meta.job_id, meta.consumer_index, meta.epoch, meta.seq, meta.dataset_length) == (7, 2, 3, 11, 20)
    expected = default_collate([Squares(20)[i] for i in (5, 1, 19)])
    assert torch.equal(batch["x"], expected["x"]) and torch.equal(batch["y"], expected["y"])


def test_a_task_sees_torchs_worker_api_as_torchs_worker_0_does(tmp_path):
    path = job_file(tmp_path, "WorkerProbe", n=8, worker_init_fn=record_worker_init)
    torch_batch = next(iter(DataLoader(WorkerProbe(8), batch_size=4, num_workers=1, worker_init_fn=record_worker_init,
                                       generator=torch.Generator().manual_seed(5))))
    base_seed = torch.empty((), dtype=torch.int64).random_(generator=torch.Generator().manual_seed(5)).item()
    for seq in (0, 1):  # worker_init_fn once per epoch, as in torch's worker
        _, batch = batch_of(produce(Task(Key(0, seq, 0, 1), path, [0, 1, 2, 3], base_seed)))
    for key in ("id", "num_workers", "seed", "init_calls", "torch_seed", "np_state"):
        assert torch.equal(batch[key], torch_batch[key]), key


def test_errors_name_their_stage_type_and_sample(tmp_path):
    meta, _ = batch_of(produce(Task(Key(0, 0, 0, 1), job_file(tmp_path, "Faulty", n=20, bad=13), [12, 13])))
    assert (meta.error.type, meta.error.stage, meta.error.sample_index, meta.error.worker) == \
        ("ZeroDivisionError", "getitem", 13, "test-worker")
    meta, _ = batch_of(produce(Task(Key(0, 0, 0, 2), job_file(tmp_path, "BrokenInit", "broken.pb"), [0])))
    assert (meta.error.type, meta.error.stage) == ("FileNotFoundError", "build")
    assert "no data at /nonexistent" in meta.error.message and "Traceback" in meta.error.traceback


def test_keyed_draws_depend_on_a_samples_place_alone(tmp_path):
    path = job_file(tmp_path, "Augmented", n=16)
    _, together = batch_of(produce(Task(Key(0, 0, 0, 1), path, [3, 4, 5], 99, places=[30, 40, 50])))
    _, alone = batch_of(produce(Task(Key(1, 7, 0, 1), path, [4], 99, places=[40])))  # another epoch, batch, process state
    assert torch.equal(together["x"][1], alone["x"][0])
    _, moved = batch_of(produce(Task(Key(0, 1, 0, 1), path, [4], 99, places=[41])))
    assert not torch.equal(moved["x"][0], alone["x"][0])


def _draw_in_worker_init(worker_id: int) -> None:
    import random

    import numpy as np
    np.random.rand(3), random.random()  # draws, seeds nothing: right after torch's worker seeding, a regeneration


def test_a_worker_init_fn_that_only_draws_leaves_the_draws_keyed(tmp_path):
    keyed = job_file(tmp_path, "Augmented", n=16)
    drawing = job_file(tmp_path, "Augmented", "drawing.pb", worker_init_fn=_draw_in_worker_init, n=16)
    _, want = batch_of(produce(Task(Key(0, 0, 0, 1), keyed, [3, 4], 99, places=[30, 40])))
    _, got = batch_of(produce(Task(Key(0, 0, 0, 2), drawing, [3, 4], 99, places=[30, 40])))
    assert torch.equal(got["x"], want["x"])
    process = runtime.current()
    assert process.contexts[process.current].users == frozenset()


def test_inspect_reports_length_kind_and_build_errors(tmp_path):
    ok = wpb.InspectResponse.FromString(runtime.inspect(1, job_file(tmp_path, "Squares", n=42)))
    assert (ok.length, ok.iterable, ok.HasField("error")) == (42, False, False)
    stream = wpb.InspectResponse.FromString(runtime.inspect(2, job_file(tmp_path, "Counting", "c.pb", n=5)))
    assert stream.iterable
    broken = wpb.InspectResponse.FromString(runtime.inspect(3, job_file(tmp_path, "BrokenInit", "b.pb")))
    assert broken.length == -1 and broken.error.type == "FileNotFoundError"


def _burning_collate(samples):
    """default_collate after 50 ms of CPU."""
    import time
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    return default_collate(samples)


def test_a_batch_says_where_its_process_spent_its_time(tmp_path):
    # issue 56: the dataset's own code (wall and CPU: sleeping is waiting, not computing), collate_fn, Dpex's rest.
    slow = job_file(tmp_path, "Slow", n=8, delay_s=0.02)
    meta, _ = batch_of(produce(Task(Key(0, 0, 0, 1), slow, [0, 1, 2, 3])))
    st = meta.stages
    assert st.dataset_s >= 0.08 and st.dataset_cpu_s < st.dataset_s / 2
    assert st.collate_s < 0.05 and st.dpex_s >= 0
    burning = job_file(tmp_path, "Squares", "burning.pb", collate_fn=_burning_collate, n=8)
    meta, batch = batch_of(produce(Task(Key(0, 0, 0, 2), burning, [0, 1])))
    st = meta.stages
    assert st.collate_cpu_s >= 0.05 and st.collate_s >= st.collate_cpu_s * 0.9 and st.dataset_s < st.collate_s
    assert batch["y"].tolist() == [0, 1]


def test_the_stage_machine_names_the_stage_that_raised_and_times_only_batches_made():
    # One for produce() and a stream's batches (issue 57 item 2).
    stages = runtime.Stages(wpb.Batch(seq=3), "build")
    with stages.timed("getitem", "dataset"):
        pass
    with pytest.raises(ValueError):
        with stages.timed("collate", "collate"):
            raise ValueError("in collate_fn")
    assert stages.stage == "collate" and stages.meta.stages.dataset_s >= 0
    failed = wpb.Batch.FromString(stages.failed(wpb.RemoteError(type="ValueError", stage=stages.stage)))
    assert failed.seq == 3 and failed.error.stage == "collate" and not failed.HasField("stages")
