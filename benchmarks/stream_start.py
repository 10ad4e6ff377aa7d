"""How long the first batch of an IterableDataset takes on a worker that has
just started, and the CPU the worker's processes spend until then: its
stream's process comes from a forkserver (since the worker forks it as it
starts; before, it spawned one, a new interpreter importing torch, at the
first stream). Two source trees side by side, alternating, in one run: each
round starts a LocalCluster of one worker in a new interpreter of each tree.

    python benchmarks/stream_start.py [ROUNDS] [TREE ...]   (default: 5 rounds, this tree)

e.g. against the commit before: ``git worktree add /tmp/before HEAD~1`` (its
generated protobuf code copied in: ``cp dpex/proto/*_pb2*.py* /tmp/before/dpex/proto/``),
then ``python benchmarks/stream_start.py 5 /tmp/before .``
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

ONE = r"""
import json, os, sys, time
import torch
from dpex import DpexDataLoader, LocalCluster
from dpex.testing import descendants

class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(8))

def cpu(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

with LocalCluster(num_workers=1, processes=1) as cluster:
    worker = cluster.workers[0].process.pid
    before = sum(cpu(p) for p in [worker, *descendants(worker)])
    began = time.perf_counter()
    loader = DpexDataLoader(Counting(), distribute_mode=True, head_address=cluster.address, batch_size=4,
                            num_workers=1)
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - began
    spent = sum(cpu(p) for p in [worker, *descendants(worker)]) - before
    list(batches)
print(json.dumps({"first_batch_s": first, "worker_cpu_s": spent}))
"""


def run(tree: str) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
    done = subprocess.run([sys.executable, "-c", ONE], env=env, cwd=os.path.abspath(tree), capture_output=True,
                          text=True, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    trees = sys.argv[2:] or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    got: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(rounds):
        for tree in trees:
            got[tree].append(run(tree))
    print(f"{'tree':<40} {'first batch, s':>15} {'worker CPU, s':>15}   (medians of {rounds})")
    medians = {}
    for tree, rows in got.items():
        medians[tree] = [statistics.median(r[k] for r in rows) for k in ("first_batch_s", "worker_cpu_s")]
        print(f"{tree:<40} {medians[tree][0]:>15.3f} {medians[tree][1]:>15.3f}")
    if len(trees) == 2:
        (a, b) = (medians[t] for t in trees)
        print(f"ratio {trees[1]} / {trees[0]}: first batch {b[0] / a[0]:.2f}x, worker CPU {b[1] / a[1]:.2f}x")


if __name__ == "__main__":
    main()
