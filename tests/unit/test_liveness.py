"""dpex.dispatcher.liveness with a fake clock: what has gone silent, and when."""
import socket

from dpex.dispatcher.liveness import Liveness, unreachable
from dpex.proto import dispatcher_pb2 as dpb


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_silent_workers_consumers_and_idle_jobs_after_their_timeouts():
    clock = Clock()
    seen = Liveness(clock)
    seen.worker("a", dpb.WorkerLoad())
    seen.worker("b")
    seen.consumer(1, 0, workers_needed=3)
    clock.now += 5
    seen.worker("b")
    assert seen.silent_workers(["a", "b", "new"], 4) == ["a"]  # one never heard of counts from now
    assert seen.since_heartbeat("a") == 5
    assert seen.workers_needed(1) == 3 and seen.workers_needed(1, max_age_s=4) == 0
    assert seen.idle_jobs([1, 2], 4) == [1]  # job 2 was never heard of: its clock starts now
    assert seen.silent_consumers(4) == [(1, 0)] and seen.silent_consumers(4) == []  # reported once
    assert not seen.consumer_heard_within(1, 0, 100)


def test_a_lost_worker_shows_no_load_and_is_forgotten_after_its_grace():
    clock = Clock()
    seen = Liveness(clock)
    seen.worker("a", dpb.WorkerLoad())
    seen.lost("a")
    assert "a" not in seen.loads and seen.lost_for(1) == []
    clock.now += 2
    assert seen.lost_for(1) == ["a"]
    seen.worker("a")  # it came back
    assert seen.lost_for(1) == []
    seen.keep_workers(["b"])
    assert seen.silent_workers(["a"], 0) == []  # forgotten: counts from now


def test_a_forgotten_job_takes_its_consumers_along():
    clock = Clock()
    seen = Liveness(clock)
    seen.consumer(1, 0, workers_needed=2)
    seen.consumer(2, 0)
    seen.forget_job(1)
    clock.now += 10
    assert seen.silent_consumers(1) == [(2, 0)] and seen.workers_needed(1) == 0


def test_an_address_nobody_listens_on_is_unreachable_and_a_listening_one_is_not():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        assert unreachable(address) is None
    assert "ConnectionRefusedError" in unreachable(address)
    assert unreachable("not-an-address") is not None


def test_a_jobs_verdict_is_its_most_waiting_consumers_recent_one():
    clock = Clock()
    seen = Liveness(clock)
    seen.consumer(1, 0, verdict=dpb.Verdict(bottleneck="none", reason="r0", wait_fraction=0.05))
    seen.consumer(1, 1, verdict=dpb.Verdict(bottleneck="storage", reason="r1", wait_fraction=0.6,
                                            stages={"dataset": 0.2}))
    seen.consumer(2, 0)  # a sync without a verdict (not measured yet): none shown
    got = seen.verdict(1)  # one rank starved, its peer not: it holds the peer back
    assert (got.bottleneck, got.consumer_index, dict(got.stages)) == ("straggler", 1, {"dataset": 0.2})
    assert "consumer 1 waited 60%" in got.reason and got.reason.endswith("storage: r1")
    assert seen.verdict(2) is None
    seen.consumer(1, 0, verdict=dpb.Verdict(bottleneck="workers", reason="r0", wait_fraction=0.5))
    assert (seen.verdict(1).bottleneck, seen.verdict(1).reason) == ("storage", "r1")  # both wait: the most's own
    seen.consumer(1, 0, verdict=dpb.Verdict(bottleneck="none", reason="r0", wait_fraction=0.05))
    clock.now += 61
    seen.consumer(1, 0, verdict=dpb.Verdict(bottleneck="none", reason="r0", wait_fraction=0.05))
    assert seen.verdict(1).consumer_index == 0  # consumer 1's is a minute old
    seen.forget_consumer(1, 0)
    assert seen.verdict(1) is None
