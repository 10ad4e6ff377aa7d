"""A short seeded chaos run in `make test`; benchmarks/chaos.py runs longer ones."""
from dpex.testing.chaos import run_chaos


def test_chaos_loses_and_duplicates_nothing():
    report = run_chaos(seed=3, epochs=2, events_per_epoch=4)
    assert sum(report.events.values()) == 8
    assert report.lost == 0 and report.duplicated == 0 and report.delivered == report.planned > 0, str(report)
