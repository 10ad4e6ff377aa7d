"""Large frames between a batch process and its daemon go through /dev/shm."""
import os

import pytest
import torch

import dpex
from dpex.testing import test_cluster
from dpex.worker import handoff

pytestmark = pytest.mark.skipif(not os.path.isdir(handoff.SHM), reason="no /dev/shm")


def test_write_then_take_round_trips_and_removes_the_file(tmp_path):
    parts = [b"head", memoryview(bytearray(range(256)) * 8192), torch.arange(1000).numpy()]
    sent = handoff.write(str(tmp_path), "f1", parts)
    assert sent is not None and sent.size == 4 + 256 * 8192 + 8000
    assert handoff.take(sent) == b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert not os.path.exists(sent.path)


def test_a_sent_file_is_kept_as_a_spare_and_the_next_frame_overwrites_it(tmp_path):
    big = handoff.write(str(tmp_path), "f1", [b"a" * 10_000])
    inode = os.stat(big.path).st_ino
    assert handoff.take(big, spares=1) == b"a" * 10_000
    assert os.listdir(tmp_path) == [handoff.SPARE + "f1"]
    small = handoff.write(str(tmp_path), "f2", [b"b" * 100, b"c"])  # reuses the spare's pages
    assert os.listdir(tmp_path) == ["f2"] and os.stat(small.path).st_ino == inode
    assert handoff.take(small, spares=1) == b"b" * 100 + b"c"  # no stale tail of the bigger frame
    third = handoff.write(str(tmp_path), "f3", [b"d"])
    fourth = handoff.write(str(tmp_path), "f4", [b"e"])  # no spare left: a new file
    handoff.take(third, spares=1)
    handoff.take(fourth, spares=1)  # one spare is enough: removed
    assert os.listdir(tmp_path) == [handoff.SPARE + "f3"]
    assert not handoff.is_handoff_path(f"{handoff.SHM}/dpex-1/{handoff.SPARE}f3")  # never mapped by a trainer


def test_write_falls_back_when_it_cannot(tmp_path):
    assert handoff.write(str(tmp_path / "missing"), "f1", [b"x"]) is None


def test_stale_directories_of_dead_daemons_are_removed():
    stale = os.path.join(handoff.SHM, "dpex-999999999")
    os.makedirs(stale, exist_ok=True)
    mine = handoff.make_dir()
    try:
        assert not os.path.exists(stale) and os.path.isdir(mine)
    finally:
        handoff.remove_dir(mine)


def test_only_files_in_a_dpex_directory_are_mapped_or_removed():
    assert handoff.is_handoff_path("/dev/shm/dpex-123/456-7")
    for bad in ("/etc/passwd", "/dev/shm/dpex-123/../x", "/dev/shm/other/1", "/dev/shm/dpex-12a/1",
                "/dev/shm/dpex-1/", "/dev/shm/dpex-1/.hidden", "dev/shm/dpex-1/1", "/dev/shm/dpex-1/a/b"):
        assert not handoff.is_handoff_path(bad), bad
    with pytest.raises(OSError, match="not a dpex hand-off file"):
        handoff.map_frame("/etc/passwd", 10)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host", "grpc"])
def test_big_batches_arrive_intact_and_the_worker_leaves_nothing_in_dev_shm(shared_memory):
    with test_cluster(num_workers=1, worker_flags=()) as c:  # the default 1 MiB threshold
        pid = c.workers[0].process.pid
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=16, dim=100_000)  # 1.6 MB batches
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, timeout=30, shared_memory=shared_memory) as dl:
            for i, batch in enumerate(dl):
                want = torch.stack([torch.arange(100_000, dtype=torch.float32) + j * j
                                    for j in range(4 * i, 4 * i + 4)])
                assert torch.equal(batch["x"], want)
                batch["x"] += 1  # the trainer owns its batches: writable, and private
            assert dl.stats().bytes_received >= 4 * 1_600_000
            left = os.listdir(os.path.join(handoff.SHM, f"dpex-{pid}"))
            assert all(f.startswith(handoff.SPARE) for f in left)  # every frame taken
            assert len(left) <= (0 if shared_memory else 1)  # spares: at most one per batch process (1 here)
    assert not os.path.exists(os.path.join(handoff.SHM, f"dpex-{pid}"))
