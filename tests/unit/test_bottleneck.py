"""dpex.bottleneck: the verdict from measured figures, each word of its
vocabulary reached by the figures that should reach it, and the what-if
consistent with the need the autoscaler is told."""
import pytest

from dpex.bottleneck import VERDICTS, Figures, need, predict, verdict

# 100 batches in 10 s: the trainer computes 20 ms a batch and waits 80 ms.
WAITING = dict(batches=100, elapsed_s=10.0, wait_s=8.0, workers_alive=2)
BUSY = dict(dataset=0.15, dataset_cpu=0.14, collate=0.02, collate_cpu=0.02, dpex=0.01, decode=0.001)


def word(**kw):
    w, reason = verdict(Figures(**{**WAITING, **kw}))
    assert w in VERDICTS and reason
    return w, reason


def test_a_trainer_that_hardly_waits_needs_nothing():
    w, reason = word(wait_s=0.5, stages=BUSY)
    assert w == "none" and "5%" in reason and "buy nothing" in reason


def test_busy_processes_call_for_workers_with_the_stages_shares():
    w, reason = word(stages=BUSY)
    assert w == "workers" and "the dataset's code 83%, collate_fn 11%, Dpex 6%" in reason
    w, reason = word(stages=dict(BUSY, dataset=0.02, dataset_cpu=0.02, collate=0.2, collate_cpu=0.2))
    assert w == "workers" and "collate_fn 87%" in reason


def test_a_dataset_waiting_on_storage_calls_for_processes():
    w, reason = word(stages=dict(BUSY, dataset_cpu=0.01))
    assert w == "storage" and "--processes" in reason


def test_a_dataset_waiting_for_a_core_is_not_storage():
    w, reason = word(stages=dict(BUSY, dataset_cpu=0.05, dataset_cpu_wait=0.1))  # a crowded host
    assert w == "workers" and "waited for a core" in reason


def test_slow_frames_on_the_wire_are_the_network():
    w, reason = word(stages=dict(BUSY, receive=0.2))  # 100 ms a batch with 2 sockets read at once
    assert w == "network" and "200.0 ms" in reason


def test_decoding_and_pinning_that_take_the_wait_are_the_trainer():
    w, reason = word(stages=dict(BUSY, decode=0.03, pin=0.02))
    assert w == "trainer" and "50.0 ms" in reason


def test_one_slow_worker_is_named():
    w, reason = word(stages=BUSY, per_worker={"a:1": 0.1, "b:2": 0.11, "c:3": 0.35})
    assert w == "straggler" and "c:3" in reason
    assert word(stages=BUSY, per_worker={"a:1": 0.1, "b:2": 0.15})[0] == "workers"  # within 2x: no straggler


def test_the_prediction_scales_the_workers_up_to_the_trainers_step_and_the_need_reaches_it():
    f = Figures(**WAITING)  # 10 batches/s from 2 workers; the trainer's step allows 50
    assert predict(f, 2) == pytest.approx(10) and predict(f, 4) == pytest.approx(20)
    assert predict(f, 100) == pytest.approx(50)  # the trainer's own step is the limit
    k = need(f, capped=False)
    assert predict(f, k) == pytest.approx(50) and predict(f, k - 1) < 50  # the fewest that keep up
    assert need(f) == min(k, 8)  # a step of at most 4x the live workers
    idle = Figures(batches=100, elapsed_s=10.0, wait_s=0.5, workers_alive=2)
    assert need(idle) == 2 and predict(idle, 4) == pytest.approx(10)  # faster workers show nothing
    assert predict(Figures(0, 0.0, 0.0, 0), 3) == 0.0


def test_processes_scale_the_supply_where_that_is_the_lever():
    f = Figures(**WAITING, processes=2.0)  # 10 batches/s from 2 workers of 2 processes
    assert predict(f, processes=4) == pytest.approx(20) and predict(f, 4, processes=4) == pytest.approx(40)
    assert predict(f, processes=100) == pytest.approx(50)  # the trainer's step is still the limit
    with pytest.raises(ValueError, match="processes are not known"):
        predict(Figures(**WAITING), processes=4)
