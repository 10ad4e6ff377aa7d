"""A worker whose /dev/shm is smaller than its batches (Docker's default is
64 MB; a batch of 64 images at 224² is 38.5 MB): batches that do not fit go
through the pipe, every one as torch's DataLoader makes it, and the worker
says once why. Before, a batch process stacking into a file it had only
ftruncate'd died of SIGBUS at its first page beyond the space (issue 61).
Run in a mount namespace of its own with an 8 MB tmpfs on /dev/shm."""
import textwrap

import pytest

from dpex.testing import mounts

pytestmark = pytest.mark.skipif(not mounts.available(), reason="needs root and unshare for a mount namespace")

SCRIPT = textwrap.dedent("""
    import glob, torch, dpex
    from torch.utils.data import DataLoader
    from dpex.testing import test_cluster
    from dpex.testing.datasets import Squares
    with test_cluster(num_workers=1, processes=2) as c:  # every batch offered to a hand-off file
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=48, dim=300_000)  # 4.8 MB batches
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, timeout=60) as dl:
            for epoch in range(2):
                got = list(dl)
                want = list(DataLoader(Squares(n=48, dim=300_000), batch_size=4))
                assert len(got) == len(want) == 12
                assert all(torch.equal(a["x"], b["x"]) and torch.equal(a["y"], b["y"]) for a, b in zip(got, want))
                del got
        log = open(c.workers[0].log_path).read()
    print("said", log.count("is too small for the batches"), "bus", "Bus error" in log or "SIGBUS" in log)
""")


def test_batches_larger_than_dev_shm_come_through_the_pipe_and_the_worker_says_why():
    done = mounts.run_with_tmpfs(SCRIPT, "/dev/shm", "8m", timeout_s=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1] == "said 1 bus False", done.stdout
