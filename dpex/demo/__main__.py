"""python -m dpex.demo: train a small CNN with Dpex workers doing the input pipeline.

With no --address, an embedded local cluster (a dispatcher and one worker
with --processes processes) runs on loopback ports and stops at the end.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn
from tqdm import tqdm

import dpex
from dpex.demo.shapes import CLASSES, generate


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(64, len(CLASSES)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="dispatcher HOST:PORT (default: embedded cluster)")
    parser.add_argument("--data", default=os.environ.get("DPEX_DEMO_DATA", ".data/shapes"),
                        help="dataset folder, made on first use (a path on the workers)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--processes", type=int, default=2, help="worker processes (embedded cluster)")
    args = parser.parse_args()

    root = os.path.abspath(args.data)
    t0 = time.perf_counter()
    generate(root)
    print(f"dataset: {root} ({time.perf_counter() - t0:.1f}s to check/make)")
    torch.manual_seed(0)
    cluster = dpex.LocalCluster(num_workers=1, processes=args.processes) if args.address is None else None
    address = cluster.address if cluster else args.address
    print(f"dispatcher: {address}" + (" (embedded local cluster)" if cluster else ""))
    try:
        train = dpex.RemoteDataLoader(address, dpex.DatasetSpec("dpex.demo.shapes:ShapesDataset",
                                                                root=root, split="train", augment=True),
                                      batch_size=args.batch_size, shuffle=True, seed=0, timeout=120)
        test = dpex.RemoteDataLoader(address, dpex.DatasetSpec("dpex.demo.shapes:ShapesDataset",
                                                               root=root, split="test"),
                                     batch_size=256, timeout=120)
        net = model()
        opt = torch.optim.Adam(net.parameters(), lr=3e-3)
        loss_fn = nn.CrossEntropyLoss()
        samples, start = 0, time.perf_counter()
        for epoch in range(args.epochs):
            net.train()
            bar = tqdm(train, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch", mininterval=1.0)
            for x, y in bar:
                opt.zero_grad()
                loss = loss_fn(net(x), y)
                loss.backward()
                opt.step()
                samples += len(y)
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
        elapsed = time.perf_counter() - start
        net.eval()
        correct = total = 0
        with torch.no_grad():
            for x, y in test:
                correct += (net(x).argmax(1) == y).sum().item()
                total += len(y)
        print(f"trained {samples} samples in {elapsed:.1f}s: {samples / elapsed:.0f} samples/s")
        print(f"test accuracy: {correct / total:.1%} on {total} images")
        train.close()
        test.close()
    finally:
        if cluster:
            cluster.close()


if __name__ == "__main__":
    main()
