"""A `torchrun --nproc_per_node=2` job SIGKILLed mid-epoch (launcher and
ranks) resumes from its ranks' checkpoints, with 2 ranks (each its own state)
and with 1 (elastic: the rest of the epoch resharded): every sample of the
epoch is seen exactly once across the two runs, every rank gets as many
batches, the next epoch is what the new number of ranks plans, and the
resumed job exits cleanly."""
import os
import random
import signal
import subprocess
import sys

import pytest
from torch.utils.data import DataLoader, DistributedSampler

N, B = 96, 4

TRAIN = """
import os, signal, sys, torch, torch.distributed as dist, dpex
ckpt, out, stop_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dl = dpex.RemoteDataLoader(os.environ["DPEX_DISPATCHER"],
                           dpex.DatasetSpec("dpex.testing.datasets:Slow", n=%d, delay_s=0.002),
                           batch_size=%d, shuffle=True, seed=5, timeout=60)
# every rank is given every saved rank's state: its own with as many ranks, a reshard with another number
states = [torch.load(os.path.join(ckpt, name)) for name in sorted(os.listdir(ckpt))]
if states:
    dl.load_state_dict(states)
pids = [None] * world
dist.all_gather_object(pids, os.getpid())
start = states[0]["epochs_started"] - (states[0]["epoch"] is not None) if states else 0
step = 0
with open(f"{out}.{rank}", "a") as f:
    for epoch in range(start, 2):
        dl.set_epoch(epoch)
        f.write(f"epoch {epoch}\\n")
        for batch in dl:
            f.write(" ".join(map(str, batch["y"].tolist())) + "\\n")
            f.flush()
            step += 1
            if not states and step == stop_at:
                torch.save(dl.state_dict(), os.path.join(ckpt, f"rank{rank}.pt"))
                dist.barrier()  # both checkpoints are on disk
                f.write("checkpoint\\n")
                f.flush()
            if not states and step == stop_at + 3 and rank == 0:  # preempted: launcher, then every rank
                os.kill(os.getppid(), signal.SIGKILL)
                for pid in pids[1:]:
                    os.kill(pid, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
    dl.close()
    dist.barrier()
    dist.destroy_process_group()
    f.write("done\\n")
""" % (N, B)


def torchrun(tmp_path, address, ranks, ckpt, out, stop_at):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    launcher = os.path.join(os.path.dirname(sys.executable), "torchrun")
    # --log-dir: else torchrun leaves a torchelastic_* directory in /tmp
    return subprocess.run([launcher, "--standalone", f"--nproc_per_node={ranks}", "--log-dir", str(tmp_path / "elastic"),
                           str(script), str(ckpt),
                           str(out), str(stop_at)], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "DPEX_DISPATCHER": address, "OMP_NUM_THREADS": "1"})


def epochs(path):
    """A rank's output: {epoch: [batch, ...]}, cut at its checkpoint (if any)."""
    got, epoch = {}, None
    for line in open(path).read().splitlines():
        if line in ("checkpoint", "done"):
            break
        if line.startswith("epoch "):
            epoch = int(line.split()[1])
            got.setdefault(epoch, [])
        else:
            got[epoch].append(list(map(int, line.split())))
    return got


def planned(ranks, epoch):
    out = []
    for rank in range(ranks):
        sampler = DistributedSampler(range(N), num_replicas=ranks, rank=rank, shuffle=True, seed=5)
        sampler.set_epoch(epoch)
        out.append([b.tolist() for b in DataLoader(range(N), batch_size=B, sampler=sampler)])
    return out


@pytest.mark.parametrize("resumed_ranks", [2, 1])
def test_a_killed_torchrun_job_resumes_with_as_many_or_fewer_ranks(cluster, tmp_path, resumed_ranks):
    ckpt, first, second = tmp_path / "ckpt", tmp_path / "first", tmp_path / "second"
    ckpt.mkdir()
    stop_at = random.randrange(1, N // 2 // B - 3)
    killed = torchrun(tmp_path, cluster.address, 2, ckpt, first, stop_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert sorted(os.listdir(ckpt)) == ["rank0.pt", "rank1.pt"]
    before = [epochs(f"{first}.{rank}") for rank in range(2)]
    assert [b[0] for b in before] == [p[:stop_at] for p in planned(2, 0)]

    resumed = torchrun(tmp_path, cluster.address, resumed_ranks, ckpt, second, 0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert all(open(f"{second}.{rank}").read().endswith("done\n") for rank in range(resumed_ranks))
    after = [epochs(f"{second}.{rank}") for rank in range(resumed_ranks)]
    assert len({len(a[0]) for a in after}) == 1, "every rank gets as many batches"
    seen = [i for part in (before, after) for rank in part for b in rank[0] for i in b]
    assert sorted(seen) == list(range(N)), "every sample of the epoch exactly once"
    if resumed_ranks == 2:  # each rank goes on with its own share
        assert [b[0] + a[0] for b, a in zip(before, after)] == planned(2, 0)
    assert [a[1] for a in after] == planned(resumed_ranks, 1), "the next epoch as this many ranks plan it"
