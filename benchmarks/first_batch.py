"""Time to first batch: from creating a RemoteDataLoader (a new job) to
holding its first batch, with the workers already running.

    .venv/bin/python benchmarks/first_batch.py [--runs 5]

Each run creates a new job: the dispatcher registers it, a worker builds the
dataset once to report its length, the plan is submitted and split, a worker
produces the first batch and the trainer receives it. Reported per dataset:
the median and worst of the runs, and the same for a fresh torch DataLoader
(whose worker processes start on the first iter()).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.pipeline import IOBound, ImageFolder, make_images  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--data", default=".data/bench-images")
    args = p.parse_args()
    root = make_images(os.path.abspath(args.data), 1536, 256)
    cases = [("trivial (64 small tensors)", "benchmarks.pipeline:IOBound", (6400, 0.0), IOBound(6400, 0.0)),
             ("image pipeline (64 PNGs)", "benchmarks.pipeline:ImageFolder", (root,), ImageFolder(root))]
    results = []
    with dpex.LocalCluster(num_workers=1, processes=args.processes) as cluster:
        for name, target, dataset_args, local in cases:
            times, torch_times = [], []
            for run in range(args.runs + 1):  # run 0 warms the worker's processes up (imports)
                start = time.perf_counter()
                with dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec(target, *dataset_args),
                                           batch_size=64, shuffle=True, timeout=60) as dl:
                    next(iter(dl))
                    elapsed = time.perf_counter() - start
                start = time.perf_counter()
                next(iter(DataLoader(local, batch_size=64, shuffle=True, num_workers=args.processes)))
                torch_elapsed = time.perf_counter() - start
                if run:
                    times.append(elapsed)
                    torch_times.append(torch_elapsed)
            results.append((name, times, torch_times))
            print(f"{name}: dpex median {statistics.median(times):.3f}s, torch {statistics.median(torch_times):.3f}s",
                  flush=True)
    print(f"\ntime to first batch, workers running (1 worker x {args.processes} processes), "
          f"{os.cpu_count()} cores, {args.runs} runs")
    print(f"{'dataset':28} {'dpex median':>11} {'dpex worst':>10} {'torch median':>12}")
    for name, times, torch_times in results:
        print(f"{name:28} {statistics.median(times):10.3f}s {max(times):9.3f}s {statistics.median(torch_times):11.3f}s")


if __name__ == "__main__":
    main()
