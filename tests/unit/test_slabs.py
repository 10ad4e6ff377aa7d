"""dpex.worker.slabs, in a batch process (this one): a default_collate batch
is stacked straight into its hand-off file, which decodes as torch's
default_collate would make it; a process's own spare comes back still mapped
(nothing faulted in again); a head too large or a batch larger than the last
takes the copy; files others removed are let go."""
import gc
import os
import shutil

import cloudpickle
import pytest
import torch
from torch.utils.data import Dataset, default_collate

import dpex
from dpex import seeding, shm
from dpex.proto import dispatcher_pb2 as dpb
from dpex.testing.datasets import Squares
from dpex.wire import decode, parse_frame
from dpex.worker import runtime, slabs
from dpex.wire.batchkey import Key
from dpex.worker.runtime import Task, produce

DIM = 8192  # 64 samples of 32 KiB: 2 MiB batches, over the 1 MiB hand-off threshold


class Worded(Dataset):
    """Samples with a long string each: a batch's msgpack head holds them all."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple:
        return torch.full((DIM,), float(i)), f"{i:04d}" * 500


@pytest.fixture
def process(tmp_path):
    """This process as a batch process of a daemon whose hand-off directory is fresh."""
    states = seeding.global_states()
    directory = os.path.join(shm.SHM, f"dpex-{os.getpid()}")
    os.makedirs(directory)
    old = runtime.use(runtime.BatchProcess("test-worker", handoff_dir=directory))
    yield directory
    if runtime.current().slabs is not None:
        runtime.current().slabs.close()
    runtime.use(old)
    seeding.restore_global_states(states)
    shutil.rmtree(directory)


def job(tmp_path, spec) -> str:
    path = tmp_path / "job.pb"
    path.write_bytes(dpb.JobDef(dataset=cloudpickle.dumps(spec), num_consumers=1, batch_size=64).SerializeToString())
    return str(path)


def received(frame):
    """What a same-host trainer gets: the file mapped from the frame's offset,
    decoded (the file comes back as a spare once the batch is gone)."""
    assert isinstance(frame, shm.Handoff)
    meta, payload = parse_frame(shm.map_frame(frame.path, frame.size, frame.offset))
    assert not meta.error.type, meta.error.traceback
    return meta, decode(payload)


def back_as_spare(frame) -> None:
    """The daemon read it (the network path): it is a spare again (dpex.shm's protocol)."""
    directory, name = os.path.split(frame.path)
    os.rename(frame.path, os.path.join(directory, shm.SPARE + name))


def given_back(directory: str) -> None:
    """The trainer dropped its batches: their files are spares again."""
    gc.collect()
    assert all(n.startswith(shm.SPARE) for n in os.listdir(directory))


def test_a_batch_is_stacked_into_its_file_and_decodes_as_torchs_default_collate(tmp_path, process):
    path, ds = job(tmp_path, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=200, dim=DIM)), Squares(200, DIM)
    for seq, first in enumerate((0, 64, 128)):
        indices = list(range(first, first + 64))
        frame = produce(Task(Key(0, seq, 0, 1), path, indices))
        meta, batch = received(frame)
        want = default_collate([ds[i] for i in indices])
        assert meta.seq == seq and torch.equal(batch["x"], want["x"]) and torch.equal(batch["y"], want["y"])
        # The first batch is copied (the size of a batch is not known yet); the next are written in place.
        assert (frame.offset > 0) == (seq > 0)
        del batch
        given_back(process)


def test_a_process_takes_its_own_spare_back_still_mapped(tmp_path, process):
    path = job(tmp_path, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=200, dim=DIM))
    mappings = []
    for seq in range(4):
        back_as_spare(produce(Task(Key(0, seq, 0, 1), path, list(range(64)))))
        mappings.append([slab.mapped for slab in runtime.current().slabs._mapped.values()] if runtime.current().slabs else [])
    # The copied first batch's file, then one file written in place, mapped once: not faulted in again.
    assert mappings[0] == [] and len(mappings[1]) == 1 and all(m == mappings[1] for m in mappings[1:])
    assert len(os.listdir(process)) <= 2


def test_a_head_too_large_for_its_room_takes_the_copy(tmp_path, process):
    path = job(tmp_path, dpex.DatasetSpec("tests.unit.test_slabs:Worded"))
    for seq in range(2):
        frame = produce(Task(Key(0, seq, 0, 1), path, list(range(64))))
        _, (x, words) = received(frame)
        assert frame.offset == 0 and words[5] == "0005" * 500 and torch.equal(x[7], torch.full((DIM,), 7.0))
        del x
        given_back(process)
    assert sum(len(w) for w in words) > slabs.HEAD


def test_a_batch_larger_than_the_last_takes_the_copy_and_the_next_fits(tmp_path, process):
    path, ds = job(tmp_path, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=200, dim=DIM)), Squares(200, DIM)
    offsets = []
    for seq, size in enumerate((40, 40, 64, 64, 40)):
        frame = produce(Task(Key(0, seq, 0, 1), path, list(range(size))))
        _, batch = received(frame)
        assert torch.equal(batch["x"], default_collate([ds[i] for i in range(size)])["x"])
        offsets.append(frame.offset)
        del batch
        given_back(process)
    assert [o > 0 for o in offsets] == [False, True, False, True, True]


def test_a_file_somebody_removed_is_let_go(tmp_path, process):
    path = job(tmp_path, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=200, dim=DIM))
    for seq in range(2):
        frame = produce(Task(Key(0, seq, 0, 1), path, list(range(64))))
    (held,) = runtime.current().slabs._mapped.values()
    os.unlink(frame.path)  # e.g. a trainer that forked while it had the file mapped
    produce(Task(Key(0, 2, 0, 1), path, list(range(64))))
    assert held not in runtime.current().slabs._mapped.values()
    del held  # the mapping goes with it: no file of the directory is held open
    fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [f for f in fds if f.startswith(process) and f.endswith("(deleted)")]
