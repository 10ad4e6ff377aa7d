"""DDP as users run it: `torchrun --nproc_per_node=2`, a loader per rank with
no job_name and no num_consumers: the ranks share one job by themselves."""
import json
import os
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader, DistributedSampler

from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import channel
from dpex.testing.datasets import Squares

TRAIN = """
import json, os, sys
import torch.distributed as dist
import dpex
if sys.argv[2] == "init":
    dist.init_process_group("gloo")
spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=22)
train = dpex.RemoteDataLoader(os.environ["DPEX_DISPATCHER"], spec, batch_size=4, shuffle=True, seed=3, timeout=60)
val = dpex.RemoteDataLoader(os.environ["DPEX_DISPATCHER"], spec, batch_size=4, timeout=60)
seen = []
for epoch in range(2):
    train.set_epoch(epoch)
    seen.append([b["y"].tolist() for b in train])
out = dict(rank=int(os.environ["RANK"]), consumer=train.consumer_index, consumers=train.num_consumers,
           train=train.job_name, val=val.job_name, val_batches=[b["y"].tolist() for b in val], seen=seen)
with open(f"{sys.argv[1]}.{out['rank']}", "w") as f:
    json.dump(out, f)
train.close(), val.close()
if dist.is_initialized():
    dist.destroy_process_group()
"""


def torchrun(tmp_path, address, mode, name):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / name
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # --log-dir: else torchrun leaves a torchelastic_* directory in /tmp
    proc = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "--log-dir", str(tmp_path / "elastic"),
                           str(script), str(out), mode],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "DPEX_DISPATCHER": address, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"{name}.{rank}").read_text()) for rank in range(2)]


def jobs(address):
    ch = channel(address)
    try:
        return {j.name: j for j in dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10).jobs}
    finally:
        ch.close()


@pytest.mark.parametrize("mode", ["init", "env"])
def test_torchrun_ranks_share_one_job_without_job_name(cluster, tmp_path, mode):
    before = set(jobs(cluster.address))
    ranks = torchrun(tmp_path, cluster.address, mode, "run1")
    for r, got in enumerate(ranks):
        assert (got["consumer"], got["consumers"]) == (r, 2)  # from the process group
        sampler = DistributedSampler(Squares(22), num_replicas=2, rank=r, shuffle=True, seed=3)
        want = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            want.append([b["y"].tolist() for b in DataLoader(Squares(22), batch_size=4, sampler=sampler)])
        assert got["seen"] == want  # DistributedSampler per rank, as torch
        val = DistributedSampler(Squares(22), num_replicas=2, rank=r, shuffle=False)
        assert got["val_batches"] == [b["y"].tolist() for b in DataLoader(Squares(22), batch_size=4, sampler=val)]
    assert ranks[0]["train"] == ranks[1]["train"] and ranks[0]["val"] == ranks[1]["val"]
    assert ranks[0]["train"] != ranks[0]["val"]  # two loaders, two jobs
    new = {name: job for name, job in jobs(cluster.address).items() if name not in before}
    assert set(new) == {ranks[0]["train"], ranks[0]["val"]}  # not one job per rank
    train = new[ranks[0]["train"]]
    assert train.num_consumers == 2 and list(train.epochs) == [1, 1]
    assert train.batches_delivered == 2 * 2 * 3  # epochs x ranks x batches
    # Another run of the same script is another job.
    again = torchrun(tmp_path, cluster.address, mode, "run2")
    assert again[0]["train"] == again[1]["train"] != ranks[0]["train"]
