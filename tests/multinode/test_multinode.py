"""Dispatcher, three workers and a trainer on separate hosts (network
namespaces with their own IPs), failures injected mid-epoch. Every test
asserts exactly-once delivery of every batch id, and that every sample was
read from a worker's own data directory — never by the trainer."""
import json

import pytest

from dpex.testing import netns
from dpex.testing.nodes import check

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")

SAMPLES, EPOCHS = 160, 2


@pytest.fixture
def hosts():
    with netns.NetnsCluster(workers=3, samples=SAMPLES) as c:
        yield c


def train(hosts, event=None, at=10, delay_s=0.01, epochs=EPOCHS):
    """Runs the trainer; calls ``event()`` when it has received batch ``at`` of epoch 0."""
    trainer = hosts.run_trainer(epochs, delay_s)
    try:
        result = None
        for line in trainer.stdout:
            if line == f"batch 0 {at}\n" and event is not None:
                event()
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        assert trainer.wait(120) == 0, trainer.stderr.read()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    check(result, SAMPLES, {n for n in hosts.nodes if n.startswith("worker")})
    return result


def served_by(result, epoch=0):
    return {n for b in result[epoch] for n in b["node"]}


def test_workers_read_their_own_data_and_share_the_work(hosts):
    result = train(hosts)
    assert served_by(result, 0) | served_by(result, 1) == {"worker1", "worker2", "worker3"}


def test_kill_a_worker(hosts):
    train(hosts, lambda: hosts.kill("worker2"))


def test_cut_a_workers_link(hosts):
    result = train(hosts, lambda: hosts.cut("worker1"))
    assert "worker1" not in served_by(result, 1)  # cut off for good: lost, its work re-planned


def test_restart_the_dispatcher(hosts):
    train(hosts, hosts.restart_dispatcher)


def test_add_a_worker(hosts):
    added = []
    # Slow samples (about 5 s an epoch), so that the new worker joins mid-run.
    # Four epochs: a worker started on a loaded machine may take most of two to come up.
    result = train(hosts, lambda: added.append(hosts.add_worker()), at=2, delay_s=0.1, epochs=4)
    assert added[0] in set().union(*(served_by(result, e) for e in range(4)))
