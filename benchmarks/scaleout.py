"""Scale-out: an I/O-bound dataset (each sample waits 5 ms, as a read from
remote storage would) served by K = 1, 2, 4, 8, 16 worker daemons of one
process each; throughput against the ideal K x single-worker throughput.
With ``--within``: one worker daemon of K processes instead (scale-up: can
one trainer keep all of a big worker's processes busy?).

    .venv/bin/python benchmarks/scaleout.py [--max-workers 16] [--seconds 3] [--within]

Workers are added to one cluster as K grows (``--within``: a cluster per K);
each K gets its own job, a warm-up epoch (the processes build the dataset),
then a timed epoch whose size is K times the single process's, so every
timed epoch ideally lasts the same. Reported: samples/s, efficiency, trainer
CPU per batch, peak RSS.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.measure import cpu_s, peak_rss_mb, reset_peak, tree  # noqa: E402


def timed(cluster: dpex.LocalCluster, k: int, n: int, args: argparse.Namespace) -> tuple:
    """A warm-up epoch of ``n`` samples, then a timed one: (k, n, wall, samples/s,
    trainer CPU ms per batch, worker RSS MB per K, trainer RSS MB)."""
    me = [os.getpid()]
    spec = dpex.DatasetSpec("benchmarks.pipeline:IOBound", n, args.wait_ms / 1000)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=args.batch_size,
                               job_name=f"scaleout-{k}", timeout=300) as dl:
        for _ in dl:  # warm-up epoch
            pass
        workers = [pid for w in cluster.workers for pid in tree(w.process.pid)]
        reset_peak(workers + me)
        cpu0, start = cpu_s(me), time.perf_counter()
        batches = sum(1 for _ in dl)
        wall = time.perf_counter() - start
        trainer_cpu = cpu_s(me) - cpu0
    return k, n, wall, n / wall, 1000 * trainer_cpu / batches, peak_rss_mb(workers) / k, peak_rss_mb(me)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-workers", type=int, default=16)
    p.add_argument("--wait-ms", type=float, default=5.0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seconds", type=float, default=3.0, help="ideal length of each timed epoch")
    p.add_argument("--within", action="store_true", help="K processes in one worker, not K workers")
    args = p.parse_args()
    per_worker = int(args.seconds * 1000 / args.wait_ms)  # samples one worker could do in --seconds
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= args.max_workers]
    rows: list[tuple] = []
    shared = None if args.within else dpex.LocalCluster(num_workers=0, processes=1, split_size_batches=2)
    try:
        for k in ks:
            if shared is None:
                with dpex.LocalCluster(num_workers=1, processes=k, split_size_batches=2) as cluster:
                    rows.append(timed(cluster, k, per_worker * k, args))
            else:
                shared.add_workers(k - len(shared.workers))
                rows.append(timed(shared, k, per_worker * k, args))
            k, n, wall, rate = rows[-1][:4]
            print(f"K={k:2d}: {n:6d} samples in {wall:5.2f}s = {rate:7.0f} samples/s, "
                  f"efficiency {rate / (k * rows[0][3]):.3f}", flush=True)
    finally:
        if shared is not None:
            shared.close()
    base = rows[0][3]
    print(f"\nI/O-bound dataset: {args.wait_ms:g} ms per sample, batch {args.batch_size}, "
          f"{'one worker of K processes' if args.within else 'K workers of 1 process'}, {os.cpu_count()} cores")
    print(f"{'K':>3} {'samples/s':>10} {'ideal':>8} {'efficiency':>10} {'trainer CPU ms/batch':>21} "
          f"{'worker RSS MB':>14} {'trainer RSS MB':>15}")
    for k, n, wall, rate, cpu_ms, wrss, trss in rows:
        print(f"{k:3d} {rate:10.0f} {k * base:8.0f} {rate / (k * base):10.3f} {cpu_ms:21.2f} {wrss:14.0f} {trss:15.0f}")


if __name__ == "__main__":
    main()
