"""The data of any step on demand (issue 59): ``loader.plan_of(step)`` over an epoch of 10^9
samples (a ShuffleSampler: each position computed, no permutation drawn whole), for a job of
1 and of 8 ranks, at random steps; beside it, what one epoch's permutation costs drawn whole
(torch.randperm, as RandomSampler and DistributedSampler(shuffle=True) draw it), at 10^7.

    .venv/bin/python benchmarks/plan_of.py [--samples 1000000000] [--calls 200]

Prints, per world size: the median and the slowest plan_of(), in ms (target: <= 100 ms).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import dpex  # noqa: E402
from dpex.testing import test_cluster  # noqa: E402

B = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10**9)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    spec = dpex.DatasetSpec("dpex.client.sampling:Indices", args.samples)
    rng = random.Random(0)
    print(f"plan_of() over an epoch of {args.samples:,} samples, batches of {B}, {args.calls} random steps")
    print(f"{'ranks':>5}  {'steps':>12}  {'median ms':>9}  {'slowest ms':>10}")
    with test_cluster(num_workers=1) as c:
        for world in (1, 8):
            sampler = dpex.ShuffleSampler(args.samples, seed=7, num_replicas=world, rank=0)
            with dpex.RemoteDataLoader(c.address, spec, batch_size=B, sampler=sampler, num_consumers=1,
                                       timeout=120) as dl:
                it = iter(dl)
                next(it)  # the epoch begun
                steps = len(dl)
                times = []
                for _ in range(args.calls):
                    step = rng.randrange(steps)
                    begun = time.perf_counter()
                    got = dl.plan_of(step)
                    times.append((time.perf_counter() - begun) * 1000)
                    assert len(got) == world and all(len(v) == B for v in got.values())
                print(f"{world:>5}  {steps:>12,}  {statistics.median(times):>9.2f}  {max(times):>10.2f}")
                del it
    begun = time.perf_counter()
    torch.randperm(10**7, generator=torch.Generator().manual_seed(0))
    print(f"for scale: one permutation of 10^7 drawn whole (torch.randperm): {time.perf_counter() - begun:.2f} s")


if __name__ == "__main__":
    main()
