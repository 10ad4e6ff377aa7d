"""Dpex on a Ray cluster whose autoscaler adds and removes nodes (Ray's fake
multi-node provider, dpex.testing.rayscale): with RayConfig(min_workers,
max_workers), a trainer that waits for data gets more workers (their actors
wait for nodes the autoscaler adds); while it pauses mid-epoch (an
evaluation) they are drained back to min_workers, their splits going to the
one left; and every batch arrives exactly once and in order across it all."""
import threading

import pytest

ray = pytest.importorskip("ray")

import dpex  # noqa: E402
import dpex.ray  # noqa: E402
from dpex.proto import dispatcher_pb2 as dpb  # noqa: E402
from dpex.proto import dispatcher_pb2_grpc as dgrpc  # noqa: E402
from dpex.rpc import call, channel  # noqa: E402
from dpex.testing import wait_until  # noqa: E402
from dpex.testing.rayscale import FakeAutoscalingCluster  # noqa: E402

SAMPLES, BATCH = 6000, 10


def alive(endpoint) -> int:
    # Retried: on a loaded machine (the suite's other files beside this one) a connection may take
    # longer than a call's 10 s ("connection attempt timed out before receiving SETTINGS frame").
    status = call(dgrpc.DispatcherStub(channel(endpoint.address, endpoint.auth_token)).GetStatus,
                  dpb.GetStatusRequest(), target="dispatcher", timeout_s=10, retry_for_s=60)
    return sum(w.state == "alive" for w in status.workers)


def test_workers_follow_what_the_trainer_needs_and_are_given_back():
    with FakeAutoscalingCluster(node_cpus=1, max_nodes=4) as cluster:
        config = dpex.ray.RayConfig(min_workers=1, max_workers=4, worker_cpus=1, scale_cooldown_s=5,
                                    dispatcher_flags=("--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"),
                                    worker_flags=("--heartbeat-interval", "0.5"))
        endpoint = dpex.ray.start(cluster.address, config, wait_s=180)
        try:
            assert len(endpoint.workers) == 1  # min_workers, on a node the autoscaler added
            counts, done = [], threading.Event()

            def watch():
                while not done.wait(0.5):
                    counts.append(alive(endpoint))
            watcher = threading.Thread(target=watch)
            watcher.start()
            spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", SAMPLES, 0.01)  # I/O-bound: 10 ms a sample
            try:
                got = []
                with dpex.RemoteDataLoader(endpoint.address, spec, batch_size=BATCH, auth_token=endpoint.auth_token,
                                           timeout=120) as loader:
                    for batch in loader:
                        got.extend(int(y) for y in batch["y"])
                        if len(got) == SAMPLES // 2:  # an evaluation: the loop reads nothing for a while
                            assert max(counts) >= 2, counts  # the waiting trainer got workers
                            wait_until(lambda: alive(endpoint) == 1, 90, "the workers drained to min_workers")
            finally:
                done.set()
                watcher.join()
            assert got == list(range(SAMPLES))  # exactly once, in order, across the scale events and the drain
            wait_until(lambda: alive(endpoint) == 1, 60, "the workers back to min_workers")
        finally:
            dpex.ray.stop(cluster.address)
