"""The stall a trainer sees when a worker is SIGKILLed mid-epoch: an epoch
with a kill against the same epoch without one, and the worst gap between
two batches, on a local cluster with the default heartbeat timeout (10 s).

    .venv/bin/python benchmarks/worker_kill.py [--rounds 3]

Each round: an epoch with nothing killed, then one where worker 0 is killed
with SIGKILL after batch 20 (a new worker takes its place before the next
round). The dead worker's batches move when the dispatcher marks it lost:
at its heartbeat timeout, or at once when a trainer reports the broken
stream and the worker's port refuses connections.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402

N, B, KILL_AT = 480, 4, 20


def epoch(cluster: dpex.LocalCluster, kill: bool) -> tuple[float, float]:
    """(seconds for the epoch, worst gap between two batches)."""
    spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.01)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, timeout=120) as dl:
        start = last = time.perf_counter()
        worst = 0.0
        for i, _ in enumerate(dl):
            now = time.perf_counter()
            worst, last = max(worst, now - last), now
            if kill and i == KILL_AT:
                cluster.kill_worker(0)
                last = time.perf_counter()  # the kill's own wait is not the trainer's stall
        return time.perf_counter() - start, worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    plain, killed = [], []
    with dpex.LocalCluster(num_workers=2, processes=1) as cluster:
        epoch(cluster, kill=False)  # warm up: the batch processes import torch
        for _ in range(args.rounds):
            plain.append(epoch(cluster, kill=False))
            killed.append(epoch(cluster, kill=True))
            cluster.workers.pop(0)
            cluster.add_workers(1)
    med = statistics.median
    print(f"worker SIGKILLed mid-epoch, 2 workers x 1 process, {N // B} batches of {B}, heartbeat timeout 10 s, "
          f"median of {args.rounds}")
    print(f"{'':28}{'epoch':>10}{'worst gap':>12}")
    print(f"{'nothing killed':28}{med(e for e, _ in plain):>9.2f}s{med(g for _, g in plain):>11.2f}s")
    print(f"{'worker 0 killed':28}{med(e for e, _ in killed):>9.2f}s{med(g for _, g in killed):>11.2f}s")
    print(f"stall (killed - nothing killed): {med(e for e, _ in killed) - med(e for e, _ in plain):.2f}s; "
          f"epoch ratio {med(e for e, _ in killed) / med(e for e, _ in plain):.2f}")


if __name__ == "__main__":
    main()
