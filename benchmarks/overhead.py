"""Overhead at equal cores: RemoteDataLoader (one local worker daemon with P
processes) against torch.utils.data.DataLoader(num_workers=P), on the same
CPU-heavy image pipeline, runs alternating in one process.

    .venv/bin/python benchmarks/overhead.py [--processes 2] [--images 1536] [--rounds 3]

Dpex runs twice per round: with its default keyed draws (each sample's
generators set from its place in the epoch, dpex.seeding) and with
``reproducible=False`` (the processes' generators run on, as torch's): the
ratio of the two is what reproducible batches cost.

"bare" is the pipeline and default_collate alone in P fresh processes (images
per CPU second, summed): the ceiling of any use of P cores, and so of the
ratio (bare / torch). "pool" is the same pipeline as a loader that sends
nothing (benchmarks.pipeline.PoolLoader: P kept processes make each epoch's
batches, the trainer counts them): what a loader can reach here, where the
epoch's start and end (about a second long) and the trainer share the cores.

Prints samples/s of each run, the medians and their ratio (Dpex / torch);
the trainer process's CPU per batch for both (for torch: its main process,
which receives and unpickles the batches); and peak RSS of the trainer and
of the Dpex worker (daemon + processes) against torch's worker processes.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.measure import cpu_s, peak_rss_mb, reset_peak, tree  # noqa: E402
from benchmarks.pipeline import ImageFolder, PoolLoader, bare_rate, make_images  # noqa: E402


def epoch_rate(loader, parts: dict[str, list[int]] | None = None,
               spent: dict[str, float] | None = None) -> tuple[float, float]:
    """samples/s, and this process's CPU ms per batch (all its threads; read
    from the kernel's clock, not /proc's 10 ms ticks: an epoch is ~50 ms).
    With ``spent``, adds to it the epoch's batches, wall seconds, the
    trainer's CPU seconds and each of ``parts``' (its processes' /proc ticks)."""
    parts = parts or {}
    before = {k: cpu_s(pids) for k, pids in parts.items()}
    cpu0, start, n, batches = time.process_time(), time.perf_counter(), 0, 0
    for x, _ in loader:
        n += len(x)
        batches += 1
    wall, trainer = time.perf_counter() - start, time.process_time() - cpu0
    if spent is not None:
        for k, v in (("batches", batches), ("wall", wall), ("trainer", trainer),
                     *((k, cpu_s(pids) - before[k]) for k, pids in parts.items())):
            spent[k] = spent.get(k, 0) + v
    return n / wall, 1000 * trainer / batches


def spent_line(name: str, spent: dict[str, float]) -> str:
    """CPU ms per batch by part, and the cores' idle time per batch."""
    cores, batches = len(os.sched_getaffinity(0)), spent["batches"]
    parts = {k: v for k, v in spent.items() if k not in ("batches", "wall")}
    idle = cores * spent["wall"] - sum(parts.values())
    return f"{name:8s} " + ", ".join(f"{k} {1000 * v / batches:5.2f}" for k, v in parts.items()) + \
        f", idle {1000 * idle / batches:5.2f}"


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
    ideal = PoolLoader(functools.partial(ImageFolder, root), args.images, B, P)
    with dpex.LocalCluster(num_workers=1, processes=P) as cluster:
        spec = dpex.DatasetSpec("benchmarks.pipeline:ImageFolder", root)
        remote = dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, shuffle=True, timeout=300)
        unkeyed = dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, shuffle=True, timeout=300,
                                        reproducible=False)
        loaders = {"torch": torch_loader, "dpex": remote, "unkeyed": unkeyed, "pool": ideal}
        for loader in loaders.values():  # warm-up: workers, page cache, dataset
            epoch_rate(loader)
        me = os.getpid()
        dpex_worker = tree(cluster.workers[0].process.pid)
        cluster_pids = set(dpex_worker) | set(tree(cluster.dispatcher.process.pid))
        pool_pids = ideal.pids
        workers = {"dpex": dpex_worker, "unkeyed": dpex_worker, "pool": pool_pids,
                   "torch": [p for p in tree(me)[1:] if p not in cluster_pids and p not in pool_pids]}
        dispatcher = tree(cluster.dispatcher.process.pid)
        parts = {"torch": {"processes": workers["torch"]}, "pool": {"processes": pool_pids},
                 **{k: {"processes": dpex_worker[1:], "daemon": dpex_worker[:1], "dispatcher": dispatcher}
                    for k in ("dpex", "unkeyed")}}
        rates: dict[str, list[float]] = {name: [] for name in loaders}
        cpu: dict[str, list[float]] = {name: [] for name in loaders}
        spent: dict[str, dict[str, float]] = {name: {} for name in loaders}  # where each one's CPU went
        rss: dict[str, tuple[float, float]] = {}
        for r in range(args.rounds):
            for name, loader in loaders.items():
                reset_peak([me, *workers[name]])
                rate, cpu_ms = epoch_rate(loader, parts[name], spent[name])
                rss[name] = (peak_rss_mb([me]), peak_rss_mb(workers[name]))
                rates[name].append(rate)
                cpu[name].append(cpu_ms)
                print(f"round {r + 1}: {name:5s} {rate:8.1f} samples/s, trainer CPU {cpu_ms:6.1f} ms/batch",
                      flush=True)
        remote.close()
        unkeyed.close()
        ideal.close()
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(P, mp_context=mp.get_context("spawn")) as pool:
        bare = sum(f.result() for f in [pool.submit(bare_rate, functools.partial(ImageFolder, root), B, 12)
                                        for _ in range(P)])
    t, d = statistics.median(rates["torch"]), statistics.median(rates["dpex"])
    u, c = statistics.median(rates["unkeyed"]), statistics.median(rates["pool"])
    tc, dc = statistics.median(cpu["torch"]), statistics.median(cpu["dpex"])
    print(f"\nimage pipeline, {args.images} PNGs {args.size}px -> 112px float, batch {B}, P={P} processes, "
          f"{os.cpu_count()} cores")
    print(f"torch DataLoader(num_workers={P}): {t:8.1f} samples/s (median of {args.rounds})")
    print(f"dpex RemoteDataLoader (1 worker x {P}): {d:8.1f} samples/s (median of {args.rounds})")
    print(f"dpex RemoteDataLoader, reproducible=False: {u:8.1f} samples/s (median of {args.rounds})")
    print(f"pipeline as a loader sending nothing (pool of {P}): {c:8.1f} samples/s (median of {args.rounds}; "
          f"pool/torch {c / t:.3f})")
    print(f"bare pipeline, {P} processes: {bare:8.1f} img per CPU second (the ceiling: bare/torch {bare / t:.3f})")
    print(f"ratio dpex/torch: {d / t:.3f}; dpex/pool {d / c:.3f}; dpex/bare {d / bare:.3f} (per round, "
          "dpex/torch: " + ", ".join(f"{a / b:.3f}" for a, b in zip(rates["dpex"], rates["torch"])) + ")")
    print(f"ratio reproducible / reproducible=False: {d / u:.3f} (per round: "
          + ", ".join(f"{a / b:.3f}" for a, b in zip(rates["dpex"], rates["unkeyed"])) + ")")
    print(f"trainer CPU per batch: torch main process {tc:.1f} ms, dpex trainer {dc:.1f} ms "
          f"(ratio {dc / tc:.2f})")
    print(f"CPU ms per batch by part, all rounds ({len(os.sched_getaffinity(0))} cores; trainer: the loop's "
          "process, its gRPC threads included; idle: the cores' time no part used):")
    for name, v in spent.items():
        print("  " + spent_line(name, v))
    print(f"peak RSS MB (last round): trainer {rss['torch'][0]:.0f} (torch) / {rss['dpex'][0]:.0f} (dpex); "
          f"workers {rss['torch'][1]:.0f} (torch's {P} processes) / {rss['dpex'][1]:.0f} (dpex daemon + "
          f"{P} processes)")


if __name__ == "__main__":
    main()
