"""dpex.dispatcher.scaling: up while trainers wait and a step helps, down
after the cool-down when a worker can go, to min_workers when nobody reads,
and no flapping under a steady load."""
import pytest

from dpex.dispatcher.scaling import Policy, ScalingConfig, Signals
from dpex.errors import DpexConfigError

CONFIG = ScalingConfig(min_workers=1, max_workers=4, settle_s=10, cooldown_s=60)


def test_waiting_trainers_get_what_their_rates_call_for_then_one_more_at_a_time_while_it_helps():
    p = Policy(CONFIG)
    d = p.decide(Signals(now=0, workers=1, trainers=1, wait=0.6, workers_needed=3, busy=1.0, throughput=10))
    assert d.target == 3 and "trainers wait 60% of the time; 1 -> 3" in d.reason
    assert p.decide(Signals(now=5, workers=3, trainers=1, wait=0.3, busy=1.0, throughput=25)).target == 3  # settling
    assert p.decide(Signals(now=12, workers=3, trainers=1, wait=0.3, busy=1.0, throughput=25)).target == 4
    assert p.decide(Signals(now=30, workers=4, trainers=1, wait=0.3, busy=1.0, throughput=33)).target == 4  # max


def test_a_step_up_that_did_not_raise_the_throughput_is_not_repeated():
    p = Policy(CONFIG)
    p.decide(Signals(now=0, workers=1, trainers=1, wait=0.5, busy=0.3, throughput=10))
    d = p.decide(Signals(now=20, workers=2, trainers=1, wait=0.5, busy=0.2, throughput=10.2))
    assert d.target == 2 and "did not raise the throughput" in d.reason


def test_workers_wait_to_start_before_more_are_asked_for():
    p = Policy(CONFIG)
    p.decide(Signals(now=0, workers=1, trainers=1, wait=0.5, throughput=10))
    d = p.decide(Signals(now=20, workers=1, trainers=1, wait=0.5, throughput=10))
    assert d.target == 2 and "waiting for 1 worker(s) to start" in d.reason


def test_down_after_the_cool_down_to_what_the_busy_processes_need_and_to_the_minimum_when_nobody_reads():
    p = Policy(CONFIG)
    p.decide(Signals(now=0, workers=1, trainers=1, wait=0.5, workers_needed=4, throughput=10))
    idle = dict(workers=4, trainers=1, wait=0.0, busy=0.3, throughput=40)
    assert p.decide(Signals(now=30, **idle)).target == 4  # within the cool-down
    d = p.decide(Signals(now=61, **idle))  # 4 x 30 % busy fits in 2 below 70 %
    assert d.target == 2 and "2 can go; 4 -> 2" in d.reason
    assert p.decide(Signals(now=100, workers=2, trainers=1, wait=0.0, busy=0.0)).target == 2  # cool-down again
    paused = p.decide(Signals(now=130, workers=2, trainers=1, wait=0.0, busy=0.0))  # an evaluation: idle workers
    assert paused.target == 1
    p.decide(Signals(now=140, workers=1, trainers=1, wait=0.5, workers_needed=3, throughput=10))  # it resumes
    assert p.target == 3
    d = p.decide(Signals(now=300, workers=3, trainers=0))
    assert d.target == 1 and "no trainer reads" in d.reason


def test_a_steady_load_between_the_thresholds_changes_nothing():
    p = Policy(CONFIG)
    p.decide(Signals(now=0, workers=2, trainers=1, wait=0.05, busy=0.9, throughput=20))
    targets = {p.decide(Signals(now=t, workers=2, trainers=1, wait=w, busy=0.9, throughput=20)).target
               for t, w in zip(range(0, 600, 5), [0.05, 0.08, 0.03, 0.09] * 40)}
    assert targets == {2}


def test_busy_workers_stay_even_when_nobody_waits():
    p = Policy(ScalingConfig(min_workers=1, max_workers=4, cooldown_s=0))
    assert p.decide(Signals(now=100, workers=3, trainers=1, wait=0.0, busy=0.8, throughput=30)).target == 3


@pytest.mark.parametrize("kw", [dict(min_workers=3, max_workers=2), dict(max_workers=0),
                                dict(up_wait=0.05, down_wait=0.05)])
def test_bounds_that_make_no_sense_are_refused(kw):
    with pytest.raises(DpexConfigError):
        ScalingConfig(**kw)
