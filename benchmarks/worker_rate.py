"""A Dpex worker's rate against torch's DataLoader workers on the same cores:
what one batch process makes of a CPU-heavy image pipeline, beside what a
torch worker process makes of it, and the pipeline run bare in a process.

    .venv/bin/python benchmarks/worker_rate.py [--cores 1] [--rounds 3]

The producers (torch's ``--cores`` worker processes, or one Dpex worker of
``--cores`` processes: its daemon and batch processes) get cores 1..cores,
the consuming process core 0, and so does the Dpex dispatcher (the control
plane, which runs elsewhere in a deployment); the consumer only takes
batches. Samples are JPEGs decoded, random-resized-cropped and flipped
into uint8 (``benchmarks.pipeline.JpegFolder``, as ``train_speed.py``).
"bare" is the dataset and torch's default_collate in one process per core,
nothing else: the ceiling. Rounds alternate; medians.
"""
from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rate(batches, steps: int, batch: int) -> float:
    it = iter(batches)
    for _ in range(3):
        next(it)
    start = time.perf_counter()
    for _ in range(steps):
        next(it)
    return steps * batch / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", type=int, default=1, help="producer cores (processes); the consumer gets one more")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=30, help="timed batches per round and producer")
    p.add_argument("--size", type=int, default=224, help="crop size (pixels)")
    p.add_argument("--image-size", type=int, default=320, help="JPEG size (pixels)")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--data", default=".data/bench-jpegs")
    args = p.parse_args()

    import torch
    from torch.utils.data import DataLoader, RandomSampler

    import dpex
    from benchmarks.measure import pin
    from benchmarks.pipeline import JpegFolder, bare_rate, make_jpegs
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < args.cores + 1:
        sys.exit(f"needs {args.cores + 1} cores, has {len(cores)}")
    consumer, producers = {cores[0]}, set(cores[1:args.cores + 1])
    root = make_jpegs(os.path.abspath(args.data), args.images, args.image_size)
    B, K, steps = args.batch_size, args.cores, args.steps * args.cores
    torch.set_num_threads(1)

    def sampler():
        return RandomSampler(range(args.images), replacement=True, num_samples=(steps + 4) * B)

    def torch_rate() -> float:
        os.sched_setaffinity(0, producers)  # the workers start at iter() and keep these cores
        loader = DataLoader(JpegFolder(root, args.size), batch_size=B, sampler=sampler(), num_workers=K,
                            prefetch_factor=4)
        it = iter(loader)
        next(it)
        os.sched_setaffinity(0, consumer)
        try:
            return _rate(it, steps, B)
        finally:
            del it

    os.sched_setaffinity(0, producers)
    cluster = dpex.LocalCluster(num_workers=1, processes=K)
    os.sched_setaffinity(0, consumer)
    pin(cluster.dispatcher.process.pid, consumer)  # the control plane, not the worker: another host's, normally
    spec = dpex.DatasetSpec("benchmarks.pipeline:JpegFolder", root, args.size)

    def dpex_rate(shared_memory: bool) -> float:
        with dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, sampler=sampler(),
                                   shared_memory=shared_memory, timeout=600) as loader:
            return _rate(loader, steps, B)

    results: dict[str, list[float]] = {"bare": [], "torch": [], "dpex same host": [], "dpex network path": []}
    spawn = mp.get_context("spawn")
    try:
        for r in range(args.rounds):
            with ProcessPoolExecutor(K, mp_context=spawn) as pool:
                bare = [pool.submit(bare_rate, functools.partial(JpegFolder, root, args.size), B, args.steps, core)
                        for core in sorted(producers)]
                results["bare"].append(sum(f.result() for f in bare))
            results["torch"].append(torch_rate())
            results["dpex same host"].append(dpex_rate(True))
            results["dpex network path"].append(dpex_rate(False))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in results.items()), flush=True)
    finally:
        cluster.close()
    med = {k: statistics.median(v) for k, v in results.items()}
    print(f"\n{K} producer core(s), batch {B} of 3x{args.size}x{args.size} uint8 crops of {args.image_size} px "
          f"JPEGs; medians of {args.rounds} rounds (img/s; bare: img per CPU second, summed over cores)")
    print(f"{'producer':20s} {'img/s':>8s} {'per core':>9s} {'x torch':>8s} {'x bare':>7s}")
    for k, v in med.items():
        print(f"{k:20s} {v:8.0f} {v / K:9.0f} {v / med['torch']:8.2f} {v / med['bare']:7.2f}")


if __name__ == "__main__":
    main()
