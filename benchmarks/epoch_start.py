"""An epoch's first batch on a loader already open: ``next(iter(loader))``
epoch after epoch (a peek, a ``break``, a validation pass), for an
IterableDataset, whose every epoch starts its streams' processes anew (as
torch's workers without persistent_workers), and for a map-style dataset.
Dpex on a local cluster of one worker; torch's DataLoader beside it.

    .venv/bin/python benchmarks/epoch_start.py [--epochs 30] [--num-workers 2]

Prints the median and the 90th percentile of each, in milliseconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402


class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(k, 1000, n))


class Items(Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


def peeks(loader, epochs: int) -> list[float]:
    times = []
    for _ in range(epochs + 1):  # the first: processes and imports warm up
        start = time.perf_counter()
        next(iter(loader))
        times.append((time.perf_counter() - start) * 1e3)
    return times[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--num-workers", type=int, default=2)
    args = p.parse_args()
    kw = dict(batch_size=8, num_workers=args.num_workers)
    rows = []
    for name, dataset in (("iterable", Stream()), ("map-style", Items())):  # torch's first: no gRPC thread yet
        rows.append((f"torch {name}", peeks(DataLoader(dataset, **kw), args.epochs)))
    with dpex.LocalCluster(num_workers=1, processes=args.num_workers) as cluster:
        for name, dataset in (("iterable", Stream()), ("map-style", Items())):
            with dpex.DpexDataLoader(dataset, distribute_mode=True, head_address=cluster.address, **kw) as dl:
                rows.append((f"Dpex {name}", peeks(dl, args.epochs)))
    print(f"{'an epoch first batch, ms':28s} {'median':>8s} {'p90':>8s}")
    for name, times in rows:
        print(f"{name:28s} {statistics.median(times):8.1f} {statistics.quantiles(times, n=10)[-1]:8.1f}")


if __name__ == "__main__":
    main()
