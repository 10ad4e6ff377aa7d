"""The injected-bottleneck suite's network case (issue 56): a worker host
whose link is shaped (tc) to a few MB/s, the trainer on another host: the
verdict is ``network``, the time reading frames off the data socket."""
import json
import os

import pytest

from dpex.testing import netns

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRAINER = """
import json, sys
import dpex
spec = dpex.DatasetSpec("dpex.testing.datasets:Sized", n=24, sizes_mb=(1,))  # 1 MiB a batch
with dpex.RemoteDataLoader(sys.argv[1], spec, batch_size=1, timeout=120) as dl:
    for _ in dl:
        pass
    s = dl.stats()
print("RESULT " + json.dumps(dict(bottleneck=s.bottleneck, reason=s.bottleneck_reason, stages=s.stages)))
"""


def test_a_worker_behind_a_slow_link_is_the_network():
    with netns.NetnsCluster(workers=1, samples=8) as hosts:
        hosts.shape("worker1", mbit=40)  # 5 MB/s: a MiB batch takes ~0.2 s on the wire, made in ~1 ms
        out = hosts.run("trainer", ["-c", TRAINER, hosts.address], cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert got["bottleneck"] == "network", got
    assert got["stages"]["receive"] > 0.1 and "link" in got["reason"]
