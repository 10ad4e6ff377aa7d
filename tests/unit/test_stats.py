"""dpex.client.stats: what the trainer measures, averaged per stage over the
batches that went through it, and the verdict it gives from them."""
from dpex.client.stats import StatsMeter
from dpex.proto import worker_pb2 as wpb


def test_stages_average_over_the_batches_that_went_through_them_and_a_slow_worker_is_named():
    meter = StatsMeter()
    meter.workers_alive = 3
    for i in range(30):
        address = ("a:1", "b:2", "c:3")[i % 3]
        made = 0.1 if address == "c:3" else 0.01  # c's copy of the data is slow
        times = wpb.StageTimes(dataset_s=made, dataset_cpu_s=made, dpex_s=0.001)
        meter.received(address, times, receive_s=0.002 if address == "a:1" else 0.0, decode_s=0.001)
        meter.record("epoch", asked_at=0.0, nbytes=10)  # asked long ago: the trainer waited for each
    meter.received("a:1", None, 0.0, 0.001)  # a batch its process did not time (an older worker)
    stats = meter.stats()
    assert abs(stats.stages["dataset"] - (20 * 0.01 + 10 * 0.1) / 30) < 1e-12  # over the 30 timed
    assert abs(stats.stages["receive"] - 10 * 0.002 / 31) < 1e-12  # over the 31 received
    assert "pin" not in stats.stages  # never measured: not shown as 0
    assert stats.bottleneck == "straggler" and "c:3" in stats.bottleneck_reason
    meter.pinned(0.5)
    assert meter.stats(reset=True).stages["pin"] == 0.5 / 31
    assert meter.stats().stages == {} and meter.stats().bottleneck == "none"  # a new window


def test_the_window_told_to_the_dispatcher_carries_its_verdict():
    import time
    meter = StatsMeter()
    meter.workers_alive = 1
    assert meter.recent_need() == 0 and meter.recent_verdict() is None  # nothing measured yet
    meter.received("a:1", wpb.StageTimes(dataset_s=1.0, dataset_cpu_s=0.01), 0.0, 0.001)
    meter.record("epoch", asked_at=time.monotonic() - 4, nbytes=10)  # 4 s waited: a window (3 s the first time)
    assert meter.recent_need() == 4  # at most 4x the live workers
    verdict = meter.recent_verdict()
    assert verdict.bottleneck == "storage" and verdict.wait_fraction > 0.99 and verdict.stages["dataset"] == 1.0
    assert meter.stats().bottleneck == "storage"  # the loader's own figures are the same arithmetic's
