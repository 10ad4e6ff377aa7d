"""Checkpoint and resume: what a loader's state costs, and how soon a resumed
loader yields again.

    .venv/bin/python benchmarks/resume.py [--samples 100000000]

For a shuffled epoch of --samples samples (batch 1024) on an embedded
cluster, mid-epoch (after a few batches): the median time of
``state_dict()`` over 1,000 calls, the bytes ``torch.save`` writes for it,
and the seconds from ``load_state_dict`` + ``iter()`` to the first batch of
a new loader, beside a fresh loader's first batch (dominated by the
worker's permutation of the whole epoch, O(n), as in torch; the resumed
loader's comes from the same worker, which keeps the permutation it drew). Cases: the
shuffle drawn from torch's global RNG, ``seed=``, the user's ``generator``,
and rank 0 of 8 (DistributedSampler).
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import dpex  # noqa: E402
from dpex.launch.local import LocalCluster  # noqa: E402

CASES = {
    "global RNG": dict(shuffle=True),
    "seed=": dict(shuffle=True, seed=1),
    "generator=": dict(shuffle=True, generator=True),
    "rank 0 of 8": dict(shuffle=True, seed=1, num_consumers=8, consumer_index=0, job_name="ranks"),
}


def loader(address: str, samples: int, kwargs: dict) -> dpex.RemoteDataLoader:
    kwargs = dict(kwargs)
    if kwargs.get("generator"):
        kwargs["generator"] = torch.Generator().manual_seed(2)
    return dpex.RemoteDataLoader(address, dpex.DatasetSpec("dpex.client.sampling:Indices", samples),
                                 batch_size=1024, timeout=300, **kwargs)


def measure(address: str, samples: int, name: str) -> dict:
    kwargs = CASES[name]
    with loader(address, samples, kwargs) as dl:
        started = time.perf_counter()
        it = iter(dl)
        next(it)
        fresh = time.perf_counter() - started
        for _ in range(3):
            next(it)
        times = []
        for _ in range(1000):
            t = time.perf_counter()
            sd = dl.state_dict()
            times.append(time.perf_counter() - t)
        buffer = io.BytesIO()
        torch.save(sd, buffer)
    with loader(address, samples, kwargs) as dl:
        started = time.perf_counter()
        dl.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
        next(iter(dl))
        resumed = time.perf_counter() - started
    return {"case": name, "state_dict_ms": statistics.median(times) * 1e3, "bytes": len(buffer.getvalue()),
            "first_batch_fresh_s": fresh, "first_batch_resumed_s": resumed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=10**8)
    args = p.parse_args()
    with LocalCluster(num_workers=1, processes=1) as cluster:
        print(f"| case ({args.samples:.0e} samples, batch 1024) | state_dict() | torch.save'd | first batch: "
              "fresh / resumed |")
        print("|---|---|---|---|")
        for name in CASES:
            r = measure(cluster.address, args.samples, name)
            print(f"| {name} | {r['state_dict_ms']:.3f} ms | {r['bytes'] / 1024:.1f} KB | "
                  f"{r['first_batch_fresh_s']:.2f} s / {r['first_batch_resumed_s']:.2f} s |", flush=True)


if __name__ == "__main__":
    main()
