"""A few seeds of the chaos campaign in `make test` (dpex.testing.chaos; the
campaign's 200 runs: benchmarks/chaos.py): a 3-rank DDP job of trainer
processes through faults of every kind, every sample it trained on compared
bitwise with an uninterrupted run of the same seed."""
import pytest

from dpex.testing.chaos import run_chaos


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [3, 4])
def test_a_job_through_faults_trains_on_the_uninterrupted_runs_samples_bitwise(seed):
    report = run_chaos(seed=seed, events=6)
    assert sum(report.events.values()) == 6, str(report)
    assert not report.failures, "\n".join(report.failures)
    assert report.lost == report.duplicated == report.unequal == 0 and report.samples == 3 * 96, str(report)
    assert report.stall_s < 60, str(report)
