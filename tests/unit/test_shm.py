"""Large frames between a batch process and its daemon go through /dev/shm."""
import gc
import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import dpex
from dpex.testing import test_cluster, wait_until
from dpex import shm

pytestmark = pytest.mark.skipif(not os.path.isdir(shm.SHM), reason="no /dev/shm")


def test_write_then_take_round_trips_and_removes_the_file(tmp_path):
    parts = [b"head", memoryview(bytearray(range(256)) * 8192), torch.arange(1000).numpy()]
    sent = shm.write(str(tmp_path), "f1", parts)
    assert sent is not None and sent.size == 4 + 256 * 8192 + 8000
    assert shm.take(sent) == b"".join(bytes(memoryview(p).cast("B")) for p in parts)
    assert not os.path.exists(sent.path)


def test_a_sent_file_is_kept_as_a_spare_and_the_next_frame_overwrites_it(tmp_path):
    big = shm.write(str(tmp_path), "f1", [b"a" * 10_000])
    inode = os.stat(big.path).st_ino
    assert shm.take(big, spares=1) == b"a" * 10_000
    assert os.listdir(tmp_path) == [shm.SPARE + "f1"]
    small = shm.write(str(tmp_path), "f2", [b"b" * 100, b"c"])  # reuses the spare's pages
    assert os.listdir(tmp_path) == ["f2"] and os.stat(small.path).st_ino == inode
    assert shm.take(small, spares=1) == b"b" * 100 + b"c"  # no stale tail of the bigger frame
    third = shm.write(str(tmp_path), "f3", [b"d"])
    fourth = shm.write(str(tmp_path), "f4", [b"e"])  # no spare left: a new file
    shm.take(third, spares=1)
    shm.take(fourth, spares=1)  # one spare is enough: removed
    assert os.listdir(tmp_path) == [shm.SPARE + "f3"]
    assert not shm.is_handoff_path(f"{shm.SHM}/dpex-1/{shm.SPARE}f3")  # never mapped by a trainer


def test_write_falls_back_when_it_cannot(tmp_path):
    assert shm.write(str(tmp_path / "missing"), "f1", [b"x"]) is None


def test_stale_directories_of_dead_daemons_are_removed():
    stale = os.path.join(shm.SHM, "dpex-999999999")
    os.makedirs(stale, exist_ok=True)
    mine = shm.make_dir()
    try:
        assert not os.path.exists(stale) and os.path.isdir(mine)
    finally:
        shm.remove_dir(mine)


def test_only_files_in_a_dpex_directory_are_mapped_or_removed():
    assert shm.is_handoff_path("/dev/shm/dpex-123/456-7")
    for bad in ("/etc/passwd", "/dev/shm/dpex-123/../x", "/dev/shm/other/1", "/dev/shm/dpex-12a/1",
                "/dev/shm/dpex-1/", "/dev/shm/dpex-1/.hidden", "dev/shm/dpex-1/1", "/dev/shm/dpex-1/a/b"):
        assert not shm.is_handoff_path(bad), bad
    with pytest.raises(OSError, match="not a dpex hand-off file"):
        shm.map_frame("/etc/passwd", 10)


def _want(i: int, dim: int = 100_000) -> torch.Tensor:
    return torch.stack([torch.arange(dim, dtype=torch.float32) + j * j for j in range(4 * i, 4 * i + 4)])


@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host", "grpc"])
def test_big_batches_arrive_intact_and_files_are_reused_never_while_mapped(shared_memory):
    with test_cluster(num_workers=1, processes=2, worker_flags=(), metrics=True) as c:  # the default 1 MiB threshold
        directory = os.path.join(shm.SHM, f"dpex-{c.workers[0].process.pid}")

        def shm_bytes(kind: str) -> float:
            page = urllib.request.urlopen(c.workers[0].metrics_url, timeout=10).read().decode()
            return next(s.value for f in text_string_to_metric_families(page) for s in f.samples
                        if s.name == "dpex_worker_shm_bytes" and s.labels == {"kind": kind})
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=32, dim=100_000)  # 1.6 MB batches
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, timeout=30, shared_memory=shared_memory) as dl:
            for epoch in range(3):
                kept = list(dl)  # every batch of the epoch alive while the worker goes on writing
                for i, batch in enumerate(kept):
                    assert torch.equal(batch["x"], _want(i)), (epoch, i)
                    batch["x"] += 1  # the trainer owns its batches: writable, and private
                lent = [f for f in os.listdir(directory) if f.startswith(f"{shm.LENT}{os.getpid()}-")]
                assert len(lent) == (8 if shared_memory else 0)
                assert shm_bytes("lent") == (sum(os.path.getsize(os.path.join(directory, f)) for f in lent)
                                             if shared_memory else 0) and shm_bytes("frame") == 0
                assert dl.stats().bytes_received >= 8 * 1_600_000 * (epoch + 1)
                del kept, batch
                gc.collect()  # the mappings go: their files come back as spares
                left = os.listdir(directory)
                assert left and all(f.startswith(shm.SPARE) for f in left), left  # every frame taken
                assert len(left) <= (8 if shared_memory else 2)  # gRPC: one per batch process
                assert shm_bytes("lent") == 0 and shm_bytes("spare") >= 1_600_000
    assert not os.path.exists(directory)


TRAINER = textwrap.dedent("""
    import sys, dpex
    dl = dpex.RemoteDataLoader(sys.argv[1], dpex.DatasetSpec("dpex.testing.datasets:Squares", n=64, dim=100_000),
                               batch_size=4, window=6)
    it = iter(dl)
    held = [next(it) for _ in range(3)]
    print("holding", flush=True)
    sys.stdin.read()
""")


def test_files_of_a_trainer_killed_while_holding_batches_are_removed():
    with test_cluster(num_workers=1, worker_flags=(), consumer_timeout_s=3.0) as c:
        directory = os.path.join(shm.SHM, f"dpex-{c.workers[0].process.pid}")
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, c.address], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
        assert trainer.stdout.readline().strip() == "holding"
        mine = f"{shm.LENT}{trainer.pid}-"
        assert sum(f.startswith(mine) for f in os.listdir(directory)) == 3
        trainer.kill()
        trainer.wait()

        def frames() -> list[str]:
            return [f for f in os.listdir(directory) if not f.startswith(shm.SPARE)]
        # Its stream ends: the files it was named but never mapped go, and the janitor
        # removes those it mapped; what is left is the worker's own buffer (--buffer-batches 8)...
        wait_until(lambda: not any(f.startswith(mine) for f in frames()) and len(frames()) <= 8, 30,
                   "the dead trainer's files to be removed")
        # ... which goes when the dispatcher releases the trainer's job.
        wait_until(lambda: not frames(), 30, "the released job's buffered frames to be removed")


def test_a_file_mapped_before_a_fork_is_not_given_back(tmp_path):
    directory = os.path.join(shm.SHM, f"dpex-{os.getpid()}")  # a name map_frame accepts
    os.makedirs(directory, exist_ok=True)
    try:
        for fork, kept in ((False, [shm.SPARE + "f"]), (True, [])):
            path = shm.write(directory, "f", [b"x" * 4096]).path
            view = shm.map_frame(path, 4096)
            assert os.listdir(directory) == [f"{shm.LENT}{os.getpid()}-f"]
            if fork:  # the child maps the file too: it must never be overwritten
                pid = os.fork()
                if pid == 0:
                    os._exit(0)
                os.waitpid(pid, 0)
            del view
            gc.collect()
            assert os.listdir(directory) == kept
            for name in kept:
                os.unlink(os.path.join(directory, name))
    finally:
        shm.remove_dir(directory)
