"""Isolation of jobs on a shared worker: job B's rate alone, and beside
another job A on the same worker whose trainer (1) left an epoch after 3
batches (a ``break``), (2) holds an epoch it does not read (paused), (3)
reads 2 batches/s (a slow consumer, in a process of its own), (4) the same
with shuffle and a seed of its own (a sweep's slow trial: the same
definition, so the worker's sharing sees both, but other batches), (5) the
same with B's own seed (a slow trial that shares every batch with B); rounds
alternate in one run.

    .venv/bin/python benchmarks/isolation.py [--rounds 3] [--processes 2] [--size 32]

Each sample waits ``--wait-ms`` (I/O) and is a uint8 image of ``--size``, so the
worker's processes, not the box's cores, are the limit. Prints B's images/s
in each setting, and the ratio to B alone (the target is >= 0.9).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402


def rate(loader) -> float:
    start, n = time.perf_counter(), 0
    for x, _ in loader:
        n += len(x)
    return n / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--wait-ms", type=float, default=1.0)
    p.add_argument("--size", type=int, default=32, help="image side, pixels")
    args = p.parse_args()
    spec = dpex.DatasetSpec("benchmarks.pipeline:IOBound", args.samples, args.wait_ms / 1000, args.size)
    B = args.batch_size
    rates: dict[str, list[float]] = {"alone": [], "left epoch": [], "paused": [], "slow consumer": [],
                                     "slow sibling": [], "slow twin": []}
    with dpex.LocalCluster(num_workers=1, processes=args.processes) as cluster:
        def loader(name: str) -> dpex.RemoteDataLoader:
            return dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, job_name=name, timeout=300,
                                         shuffle=True, seed=1)

        job_b = loader("B")
        rate(job_b)  # warm-up: processes and dataset built
        def slow_script(name: str, seed: int | None) -> str:
            return textwrap.dedent(f"""
                import sys, time, dpex
                loader = dpex.RemoteDataLoader({cluster.address!r}, dpex.DatasetSpec("benchmarks.pipeline:IOBound",
                                               {args.samples}, {args.wait_ms / 1000}, {args.size}), batch_size={B},
                                               job_name={name!r}, shuffle={seed is not None}, seed={seed})
                print("ready", flush=True)
                while True:
                    for batch in loader:
                        time.sleep(0.5)
            """)
        for r in range(args.rounds):
            rates["alone"].append(rate(job_b))

            with loader(f"left-{r}") as a:
                for i, _ in enumerate(a):
                    if i == 2:
                        break  # e.g. a look at a few validation batches
                rates["left epoch"].append(rate(job_b))

            with loader(f"paused-{r}") as a:
                held = iter(a)
                next(held)  # the trainer holds the epoch and does something else
                rates["paused"].append(rate(job_b))
                del held

            for setting, seed in (("slow consumer", None), ("slow sibling", 2), ("slow twin", 1)):
                slow = subprocess.Popen([sys.executable, "-c", slow_script(f"{setting}-{r}", seed)],
                                        stdout=subprocess.PIPE, text=True,
                                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
                try:
                    slow.stdout.readline()
                    time.sleep(1.0)  # let it fill what it may hold
                    rates[setting].append(rate(job_b))
                finally:
                    slow.kill()
                    slow.wait()
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.0f}" for k, v in rates.items()) + " img/s",
                  flush=True)
        job_b.close()
    alone = statistics.median(rates["alone"])
    print(f"\njob B on one worker of {args.processes} processes, batch {B}, {args.wait_ms:g} ms per sample; "
          f"medians of {args.rounds} rounds")
    for k, v in rates.items():
        m = statistics.median(v)
        print(f"{k:14s} {m:8.0f} img/s   / alone {m / alone:.2f}")


if __name__ == "__main__":
    main()
