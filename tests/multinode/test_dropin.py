"""The drop-in on separate hosts: torch's DataLoader in the trainer's
namespace is the oracle for DpexDataLoader whose workers run on two other
hosts (network namespaces with their own IPs), with the dataset shipped by
value and built there from a DatasetSpec."""
import json
import os
import sys

import pytest

from dpex.testing import netns

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = 12

# Runs in the trainer's namespace: each scenario of the single-host oracle suite, through torch and Dpex.
TRAINER = """
import json, os, sys, tempfile, types
import torch
from torch.utils.data import DataLoader
from tests.integration import test_torch_oracle as oracle
from dpex import DatasetSpec, DpexDataLoader
from dpex.testing.datasets import NodeFiles
from dpex.testing.nodes import write_node_data

address, samples = sys.argv[1], int(sys.argv[2])
cluster = types.SimpleNamespace(address=address)
result = {}
for name in sys.argv[3].split(","):
    dataset_fn, kwargs = oracle.SCENARIOS[name]
    theirs, ours = oracle.both(cluster, dataset_fn, **kwargs)
    result[name] = theirs == ours or [theirs, ours]

# The user's own classes, a dataset changed before iter(), a bound worker_init_fn: as in torch.
batches = list(DpexDataLoader(oracle.NamedTupleDataset(), distribute_mode=True, head_address=address, batch_size=2))
result["namedtuple"] = [type(b) is oracle.NamedTupleDataset.Batch for b in batches]
dataset = oracle.Offset()
loader = DpexDataLoader(dataset, distribute_mode=True, head_address=address, batch_size=4)
dataset.start = 0
result["taken_at_iter"] = [b.tolist() for b in loader]
init = oracle.InitSetsState()
result["bound_init"] = [b.tolist() for b in DpexDataLoader(init, distribute_mode=True, head_address=address,
                                                           batch_size=2, num_workers=1, worker_init_fn=init.init)]

# A DatasetSpec built on the workers from their own files, no auto-batching, shuffled: the trainer
# has a copy of its own only for torch's run, as the oracle.
local = tempfile.mkdtemp()
write_node_data(local, "trainer", samples)
def run(make, n):
    out = []
    it = iter(make(n))
    while True:
        try:
            item = next(it)
        except StopIteration:
            return out
        except Exception as e:
            out.append(["raised", oracle.kind(e).__name__])
            continue
        out.append([item["i"], type(item["i"]).__name__, item["node"]])
kw = dict(batch_size=None, shuffle=True)
theirs = run(lambda n: DataLoader(NodeFiles(n, root=local), generator=torch.Generator().manual_seed(7), **kw),
             samples + 2)
ours = run(lambda n: DpexDataLoader(DatasetSpec("dpex.testing.datasets:NodeFiles", n=n), distribute_mode=True,
                                    head_address=address, generator=torch.Generator().manual_seed(7), **kw),
           samples + 2)
result["spec"] = [theirs, ours]
print("RESULT " + json.dumps(result), flush=True)
"""

# (Not "context_fork": torch's own workers forked from a trainer whose gRPC threads are busy may hang;
# that Dpex accepts the argument is checked by the single-host suite.)
NAMES = ["unbatched", "unbatched_list_sampler", "unbatched_iterable_two_workers", "getitems_shuffled",
         "errors_in_getitem", "errors_not_rebuildable", "errors_in_collate", "context_object"]


def test_torchs_behaviour_holds_with_workers_on_other_hosts():
    with netns.NetnsCluster(workers=2, samples=SAMPLES) as hosts:
        done = hosts.run("trainer", ["-c", TRAINER, hosts.address, str(SAMPLES), ",".join(NAMES)], cwd=ROOT,
                         timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert {name: result[name] for name in NAMES} == {name: True for name in NAMES}
    assert result["namedtuple"] == [True, True]
    assert result["taken_at_iter"] == [[0, 1, 2, 3], [4, 5]]
    assert result["bound_init"] == [[7, 7], [7, 7]]
    theirs, ours = result["spec"]
    strip = [row[:2] if row[0] != "raised" else row for row in theirs]
    assert [row[:2] if row[0] != "raised" else row for row in ours] == strip  # same order, types and errors
    assert [row[1] for row in ours if row[0] == "raised"] == ["FileNotFoundError"] * 2
    assert {row[2] for row in ours if row[0] != "raised"} <= {"worker1", "worker2"}  # read on the workers
