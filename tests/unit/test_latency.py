"""dpex.latency: the buckets every histogram shares, and reports that count once."""
from prometheus_client.openmetrics.exposition import generate_latest
from prometheus_client import CollectorRegistry

from dpex import latency, metrics


def test_a_value_on_a_bound_falls_in_its_bucket_and_the_rest_in_inf():
    counts = latency.Counts()
    for seconds in (0.0, 0.0005, 0.0006, 60.0, 61.0):
        counts.observe(seconds)
    assert counts.counts[0] == 2 and counts.counts[1] == 1
    assert counts.counts[latency.BOUNDS.index(60.0)] == 1 and counts.counts[-1] == 1
    assert counts.total == 5 and abs(counts.sum_s - 121.0011) < 1e-9


def test_a_cumulative_report_received_twice_counts_once_and_a_restart_counts_afresh():
    series = latency.Latencies()
    first = [1, 2] + [0] * (len(latency.BOUNDS) - 1)
    series.grew("loader", first, 1.0, "job")
    series.grew("loader", first, 1.0, "job")                    # the same sync again
    series.grew("loader", [3, 2] + first[2:], 1.5, "job")       # two more observations
    series.grew("loader", [1] + [0] * len(latency.BOUNDS), 0.1, "job")  # it began again
    ((labels, counts, sum_s),) = series.series()
    assert labels == ("job",) and counts[:2] == [4, 2] and abs(sum_s - 1.6) < 1e-9
    series.forget(lambda labels: labels != ("job",), lambda reporter: reporter != "loader")
    assert series.series() == []


def test_the_histogram_reads_as_prometheus_cumulative_buckets():
    series = latency.Latencies()
    for seconds in (0.003, 0.003, 0.2, 100.0):
        series.observe(seconds, "SyncConsumer")
    registry = CollectorRegistry()
    registry.register(type("C", (), {"collect": lambda self: [
        metrics.histogram("dpex_rpc_seconds", "doc", series, ["method"])]})())
    text = generate_latest(registry).decode()
    assert 'dpex_rpc_seconds_bucket{le="0.0025",method="SyncConsumer"} 0' in text
    assert 'dpex_rpc_seconds_bucket{le="0.005",method="SyncConsumer"} 2' in text
    assert 'dpex_rpc_seconds_bucket{le="60.0",method="SyncConsumer"} 3' in text
    assert 'dpex_rpc_seconds_bucket{le="+Inf",method="SyncConsumer"} 4' in text
    assert 'dpex_rpc_seconds_count{method="SyncConsumer"} 4' in text
