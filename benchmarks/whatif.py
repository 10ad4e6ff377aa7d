"""The what-if against the measure (issue 56): an I/O-bound dataset (each
sample waits on "storage") read by a trainer of a fixed step with 1 worker;
``loader.stats().predict(workers=k)`` for k = 2, 3, 4; then the rate measured
with k workers. Each worker is one process on its own (local) daemon, as
workers on k hosts would be.

    .venv/bin/python benchmarks/whatif.py [--batches 300] [--delay-ms 5] [--step-ms 5]

Prints a table: k, predicted and measured batches/s, and their ratio.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from dpex.testing import test_cluster  # noqa: E402

B = 8


def measure(workers: int, batches: int, delay_s: float, step_s: float, processes: int = 1) -> dpex.LoaderStats:
    """The trainer's stats over ``batches`` batches (after a first epoch's start) with ``workers`` workers."""
    spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=B * (batches + 20), delay_s=delay_s)
    with test_cluster(num_workers=workers, processes=processes) as c:
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=120) as dl:
            it = iter(dl)
            for _ in range(20):  # the epoch's start and the workers' first splits: not what is compared
                next(it)
            dl.stats(reset=True)
            for _ in range(batches):
                next(it)
                time.sleep(step_s)
            return dl.stats()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--delay-ms", type=float, default=5.0, help="a sample's wait on storage")
    p.add_argument("--step-ms", type=float, default=5.0, help="the trainer's own step")
    a = p.parse_args()
    delay_s, step_s = a.delay_ms / 1000, a.step_ms / 1000
    one = measure(1, a.batches, delay_s, step_s)
    print(f"1 worker: {one.batches_per_s:.1f} batches/s, waited {100 * one.wait_fraction:.0f}%, "
          f"verdict {one.bottleneck}: {one.bottleneck_reason}")
    print(f"{'workers':>7}  {'predicted':>9}  {'measured':>8}  {'ratio':>5}")
    for k in (2, 3, 4):
        predicted = one.predict(k)
        measured = measure(k, a.batches, delay_s, step_s).batches_per_s
        print(f"{k:>7}  {predicted:>9.1f}  {measured:>8.1f}  {measured / predicted:>5.2f}", flush=True)
    print(f"{'1 worker, processes':>19}  {'predicted':>9}  {'measured':>8}  {'ratio':>5}")
    for p in (2, 3):  # the storage verdict's lever: more processes waiting on the same cores
        predicted = one.predict(processes=p)
        measured = measure(1, a.batches, delay_s, step_s, processes=p).batches_per_s
        print(f"{p:>19}  {predicted:>9.1f}  {measured:>8.1f}  {measured / predicted:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
