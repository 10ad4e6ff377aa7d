"""Reproducible batches across hosts: the trainer's own embedded cluster (one
host) is the reference for a cluster whose workers run on two other hosts
(network namespaces with their own IPs), also when one of those hosts'
worker is killed mid-epoch, and when the epoch is resumed from a state dict."""
import json
import os
import subprocess
import sys

import pytest

from dpex.testing import netns

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAINER = """
import json, sys
import dpex
from dpex.testing import datasets
from dpex.testing.compare import read_epochs

address = sys.argv[1]
spec = dpex.DatasetSpec("dpex.testing.datasets:Augmented", n=96)

def epochs(where, stop_at=None, state=None, on_batch=None):
    with dpex.RemoteDataLoader(where, spec, batch_size=8, shuffle=True, seed=5, collate_fn=datasets.mixup,
                               timeout=60) as dl:
        return read_epochs(dl, 2, value=lambda _, batch: {k: v.tolist() for k, v in batch.items()},
                           stop_at=stop_at, state=state, on_batch=on_batch)

def kill(count):  # the test kills worker1's daemon, then says so
    if count == 4:
        print("KILL", flush=True)
        assert sys.stdin.readline().strip() == "killed"

reference, _ = epochs(None)  # this host's embedded cluster
first, sd = epochs(address, stop_at=7)
rest, _ = epochs(address, state=sd)
killed, _ = epochs(address, on_batch=kill)
print("RESULT " + json.dumps(dict(batches=len(reference), remote=first + rest == reference,
                                  killed=killed == reference)), flush=True)
"""


def test_the_same_draws_on_two_other_hosts_through_a_kill_and_a_resume():
    with netns.NetnsCluster(workers=2, samples=8) as hosts:
        trainer = subprocess.Popen(["ip", "netns", "exec", hosts.ns("trainer"), sys.executable, "-c", TRAINER,
                                    hosts.address], cwd=ROOT, env=hosts._trainer_env(), stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = trainer.stdout.readline()
            assert line.strip() == "KILL", trainer.stderr.read()[-4000:]
            hosts.kill("worker1")
            trainer.stdin.write("killed\n")
            trainer.stdin.flush()
            out, err = trainer.communicate(timeout=300)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait()
    assert trainer.returncode == 0, err[-4000:]
    assert json.loads(out.split("RESULT ", 1)[1]) == dict(batches=24, remote=True, killed=True)
