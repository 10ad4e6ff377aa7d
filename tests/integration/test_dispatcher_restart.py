"""kill -9 of the dispatcher mid-epoch: with --work-dir it replays its journal
and the epoch completes exactly once; without, trainers get a clear error."""
import random
import subprocess
import sys
import os

import pytest

import dpex
from dpex.testing import status_tables, test_cluster

N, B = 200, 4
EXPECTED = [list(range(i, i + B)) for i in range(0, N, B)]
SPEC = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)


def test_restart_with_work_dir_completes_the_epoch_exactly_once(tmp_path):
    with test_cluster(num_workers=2, work_dir=str(tmp_path)) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, timeout=60, job_name="survivor") as dl:
            for epoch in range(2):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if epoch == 0 and i in (10, 30):  # twice, the second time after the first restart
                        c.restart_dispatcher()
                assert got == EXPECTED
        status = subprocess.run([os.path.join(os.path.dirname(sys.executable), "dpex"), "status",
                                 "--dispatcher", c.address], capture_output=True, text=True)
        job = next(j for j in status_tables(status.stdout)["JOBS"] if j["NAME"] == "survivor")
        assert job["PLANNED"] == job["DELIVERED"] == str(2 * len(EXPECTED))  # over both epochs
        assert "WORKERS (2 alive, 0 lost, 0 left)" in status.stdout


def test_restart_without_work_dir_fails_clearly(tmp_path):
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, timeout=60) as dl:
            with pytest.raises(dpex.DpexNotFoundError, match="restarted without --work-dir"):
                for i, _ in enumerate(dl):
                    if i == 5:
                        c.restart_dispatcher()


def test_kill_at_random_points_with_snapshots_every_few_records_loses_nothing(tmp_path):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kills = {(epoch, rng.randrange(len(EXPECTED))) for epoch in range(3) for _ in range(2)}
    # A snapshot every kilobyte of log: a kill often lands in or next to one.
    with test_cluster(num_workers=2, work_dir=str(tmp_path), dispatcher_flags=("--journal-compact-kb", "1")) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, timeout=60, job_name="kills") as dl:
            for epoch in range(3):
                got = []
                for i, batch in enumerate(dl):
                    got.append(batch["y"].tolist())
                    if (epoch, i) in kills:
                        c.restart_dispatcher()
                assert got == EXPECTED, f"seed {seed}"
        files = sorted(os.listdir(tmp_path))
        assert "snapshot" in files and len([f for f in files if f.endswith(".log")]) == 1, files
        assert sum(os.path.getsize(os.path.join(tmp_path, f)) for f in files if f != "plans") < 16 << 10
