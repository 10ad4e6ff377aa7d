"""Overhead at equal cores: RemoteDataLoader (one local worker daemon with P
processes) against torch.utils.data.DataLoader(num_workers=P), on the same
CPU-heavy image pipeline, runs alternating in one process.

    .venv/bin/python benchmarks/overhead.py [--processes 2] [--images 1536] [--rounds 3]

Prints samples/s of each run, the medians and their ratio (Dpex / torch).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.pipeline import ImageFolder, make_images  # noqa: E402


def epoch_rate(loader) -> float:
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--images", type=int, default=1536)
    p.add_argument("--size", type=int, default=256, help="stored PNG size (pixels)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--data", default=".data/bench-images")
    args = p.parse_args()

    root = make_images(os.path.abspath(args.data), args.images, args.size)
    torch.set_num_threads(1)
    P, B = args.processes, args.batch_size
    torch_loader = DataLoader(ImageFolder(root), batch_size=B, shuffle=True, num_workers=P,
                              persistent_workers=True, prefetch_factor=4)
    with dpex.LocalCluster(num_workers=1, processes=P) as cluster:
        remote = dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec("benchmarks.pipeline:ImageFolder", root),
                                       batch_size=B, shuffle=True, timeout=300)
        epoch_rate(torch_loader), epoch_rate(remote)  # warm-up: workers, page cache, dataset build
        rates: dict[str, list[float]] = {"torch": [], "dpex": []}
        for r in range(args.rounds):
            for name, loader in (("torch", torch_loader), ("dpex", remote)):
                rates[name].append(epoch_rate(loader))
                print(f"round {r + 1}: {name:5s} {rates[name][-1]:8.1f} samples/s", flush=True)
        remote.close()
    t, d = statistics.median(rates["torch"]), statistics.median(rates["dpex"])
    print(f"\nimage pipeline, {args.images} PNGs {args.size}px -> 112px float, batch {B}, P={P} processes, "
          f"{os.cpu_count()} cores")
    print(f"torch DataLoader(num_workers={P}): {t:8.1f} samples/s (median of {args.rounds})")
    print(f"dpex RemoteDataLoader (1 worker x {P}): {d:8.1f} samples/s (median of {args.rounds})")
    print(f"ratio dpex/torch: {d / t:.3f}")


if __name__ == "__main__":
    main()
