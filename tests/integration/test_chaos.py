"""A few seeds of the chaos campaign in `make test` (dpex.testing.chaos; the
campaign's 200 runs: benchmarks/chaos.py): a 3-rank DDP job of trainer
processes through faults of every kind, every sample it trained on compared
bitwise with an uninterrupted run of the same seed; the second seed with the
dispatcher's journal on a small tmpfs that faults fill (root only)."""
import textwrap

import pytest

from dpex.testing import mounts
from dpex.testing.chaos import run_chaos

FULL_DISK = textwrap.dedent("""
    import sys
    from dpex.testing.chaos import run_chaos
    report = run_chaos(seed=int(sys.argv[2]), events=8, journal_dir=sys.argv[1])
    print("\\n".join(report.failures))
    print(report.events["full_disk"], report.lost, report.duplicated, report.unequal, report.samples,
          report.stall_s < 60, sum(report.events.values()))
""")


@pytest.mark.timeout(600)
def test_a_job_through_faults_trains_on_the_uninterrupted_runs_samples_bitwise():
    report = run_chaos(seed=3, events=6)
    assert sum(report.events.values()) == 6, str(report)
    assert not report.failures, "\n".join(report.failures)
    assert report.lost == report.duplicated == report.unequal == 0 and report.samples == 3 * 96, str(report)
    assert report.stall_s < 60, str(report)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not mounts.available(), reason="needs root and unshare for a mount namespace")
def test_the_same_with_the_journal_on_a_disk_that_fills_at_times(tmp_path):
    # seed 5000 draws full_disk twice among its 8 faults
    done = mounts.run_with_tmpfs(FULL_DISK, str(tmp_path), "4m", str(tmp_path), "5000", timeout_s=500)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.splitlines()[-1] == "2 0 0 0 288 True 8", done.stdout[-4000:]
