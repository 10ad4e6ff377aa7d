"""Training speed: a real training loop fed by torch's DataLoader on the
trainer's own cores, by Dpex on the same host, and by Dpex over gRPC
(``shared_memory=False``, what a trainer on another host gets), in one run of
alternating rounds, each loader closed before the next.

    .venv/bin/python benchmarks/train_speed.py [--rounds 3] [--trainer-cores N]

The trainer process is confined to the first ``--trainer-cores`` cores
(``os.sched_setaffinity``), the Dpex worker daemon and its processes to the
others; torch's DataLoader gets ``trainer-cores - 1`` worker processes (at
least one) on the trainer's cores, as on a GPU box with few cores. Samples
are JPEGs decoded, random-resized-cropped and flipped on the workers into
uint8; the trainer normalises on its device. With a GPU and torchvision:
ResNet-50, bf16 autocast, channels_last, batch 128 at 224 px; otherwise a
small CNN on the CPU at 64 px.

Prints per round and as medians: images/s, the share of time the trainer
waited for data, the trainer process's CPU seconds per GB of batches it
received (model included), and the ratios of each Dpex path to torch's
DataLoader; then, per feeding, the loader alone (batches taken to the device,
no model): the trainer's CPU per GB that the data path itself costs. With
``--modes synthetic,...``, the rate on batches already on the device (the
model's own limit).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.pipeline import JpegFolder, make_jpegs  # noqa: E402

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def small_cnn(classes: int = 1000) -> nn.Module:
    def block(i: int, o: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(),
                             nn.MaxPool2d(2))
    return nn.Sequential(nn.AvgPool2d(2), block(3, 16), block(16, 32), block(32, 64), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(64, classes))


class Trainer:
    def __init__(self, device: torch.device, gpu_model: bool) -> None:
        self.device = device
        if gpu_model:
            import torchvision
            model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
        else:
            model = small_cnn().to(device)
        self.model, self.gpu = model, device.type == "cuda"
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        self.mean, self.std = MEAN.to(device), STD.to(device)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        x = (x.float() - self.mean) / self.std
        if self.gpu:
            x = x.contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.gpu):
            loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


def run(trainer: Trainer | None, batches, warmup: int, steps: int, batch_size: int) -> dict:
    """Trains ``warmup`` then ``steps`` steps; img/s, wait share and the
    trainer process's CPU per GB of the timed part. Without a trainer, only
    takes the batches to the device: what the loader alone costs."""
    it = iter(batches)
    device = trainer.device if trainer is not None else DEVICE
    for _ in range(warmup):
        x, y = next(it)
        trainer.step(x, y) if trainer is not None else x.to(device, non_blocking=True)
    sync()
    waited, nbytes = 0.0, 0
    cpu0, start = time.process_time(), time.perf_counter()
    for _ in range(steps):
        asked = time.perf_counter()
        x, y = next(it)
        waited += time.perf_counter() - asked
        nbytes += x.numel() * x.element_size() + y.numel() * y.element_size()
        trainer.step(x, y) if trainer is not None else x.to(device, non_blocking=True)
    sync()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {"img_s": steps * batch_size / wall, "wait": waited / wall, "cpu_gb": cpu / (nbytes / 1e9)}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Synthetic:
    """Batches already on the device: the model's own limit."""

    def __init__(self, device: torch.device, batch_size: int, size: int) -> None:
        self.x = torch.randint(0, 256, (batch_size, 3, size, size), dtype=torch.uint8, device=device)
        self.y = torch.randint(0, 1000, (batch_size,), device=device)

    def __iter__(self):
        while True:
            yield self.x, self.y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cores = sorted(os.sched_getaffinity(0))
    gpu = torch.cuda.is_available()
    try:
        import torchvision  # noqa: F401
        has_tv = True
    except ImportError:
        has_tv = False
    big = gpu and has_tv
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trainer-cores", type=int, default=4 if len(cores) >= 8 else 1)
    p.add_argument("--processes", type=int, default=None, help="Dpex worker processes [the other cores]")
    p.add_argument("--batch-size", type=int, default=128 if big else 32)
    p.add_argument("--size", type=int, default=224 if big else 64, help="crop size (pixels)")
    p.add_argument("--images", type=int, default=2048 if big else 512)
    p.add_argument("--steps", type=int, default=60 if big else 40, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=10 if big else 5)
    p.add_argument("--modes", default="torch,dpex-shm,dpex-grpc")
    p.add_argument("--data", default=".data/bench-jpegs")
    args = p.parse_args()

    k = min(args.trainer_cores, len(cores) - 1)
    trainer_cores, worker_cores = cores[:k], cores[k:]
    processes = args.processes or len(worker_cores)
    root = make_jpegs(os.path.abspath(args.data), args.images, max(320, args.size + 96))
    device = torch.device("cuda" if gpu else "cpu")
    B, S, W = args.batch_size, args.steps, args.warmup
    modes = args.modes.split(",")
    sampler_n = (W + S) * B

    os.sched_setaffinity(0, worker_cores)  # the worker daemons inherit these cores
    cluster = dpex.LocalCluster(num_workers=1, processes=processes) if any(m.startswith("dpex") for m in modes) \
        else None
    os.sched_setaffinity(0, trainer_cores)
    if not gpu:  # the CPU is the training device: one intra-op thread per core it has (spinning
        torch.set_num_threads(len(trainer_cores))  # OpenMP threads on fewer cores crawl)
    trainer = Trainer(device, big)
    spec = dpex.DatasetSpec("benchmarks.pipeline:JpegFolder", root, args.size)

    def loader(mode: str):
        sampler = RandomSampler(range(args.images), replacement=True, num_samples=sampler_n)
        if mode == "torch":
            return DataLoader(JpegFolder(root, args.size), batch_size=B, sampler=sampler,
                              num_workers=max(1, k - 1), pin_memory=gpu, prefetch_factor=4)
        if mode == "synthetic":
            return Synthetic(device, B, args.size)
        return dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, sampler=sampler, pin_memory=gpu,
                                     shared_memory=(mode == "dpex-shm"), timeout=600)

    print(f"{'GPU ' + torch.cuda.get_device_name() if gpu else 'CPU'}; model "
          f"{'ResNet-50 bf16 channels_last' if big else 'small CNN'}; batch {B} of 3x{args.size}x{args.size} "
          f"uint8 JPEG crops; trainer on cores {trainer_cores} (torch DataLoader: {max(1, k - 1)} workers "
          f"there), Dpex worker of {processes} processes on cores {worker_cores}; "
          f"torch threads {torch.get_num_threads()}; pin_memory={gpu}", flush=True)
    results: dict[str, list[dict]] = {m: [] for m in modes}
    alone: dict[str, dict] = {}
    try:
        for r in range(args.rounds):
            for mode in modes:
                batches = loader(mode)
                try:
                    res = run(trainer, batches, W, S, B)
                finally:
                    if hasattr(batches, "close"):
                        batches.close()
                    del batches
                results[mode].append(res)
                print(f"round {r + 1} {mode:10s} {res['img_s']:8.0f} img/s  waiting {100 * res['wait']:5.1f} %  "
                      f"trainer CPU {res['cpu_gb']:6.2f} s/GB", flush=True)
        for mode in modes:  # the loader alone: its CPU per GB without the model's
            if mode == "synthetic":
                continue
            batches = loader(mode)
            try:
                alone[mode] = run(None, batches, W, S, B)
            finally:
                if hasattr(batches, "close"):
                    batches.close()
                del batches
            print(f"loader alone {mode:10s} {alone[mode]['img_s']:8.0f} img/s  "
                  f"trainer CPU {alone[mode]['cpu_gb']:6.2f} s/GB", flush=True)
    finally:
        if cluster is not None:
            cluster.close()
    med = {m: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for m, rs in results.items()}
    print(f"\nmedians of {args.rounds} rounds:")
    print(f"{'feeding':12s} {'img/s':>8s} {'waiting':>8s} {'CPU s/GB':>9s} {'vs torch':>9s} "
          f"{'loader alone: CPU s/GB':>23s}")
    for m, v in med.items():
        ratio = f"{v['img_s'] / med['torch']['img_s']:.2f}x" if "torch" in med else ""
        own = f"{alone[m]['cpu_gb']:.2f}" if m in alone else ""
        print(f"{m:12s} {v['img_s']:8.0f} {100 * v['wait']:7.1f}% {v['cpu_gb']:9.2f} {ratio:>9s} {own:>23s}")
    if "dpex-grpc" in med and "dpex-shm" in med:
        print(f"dpex gRPC / dpex same host: {med['dpex-grpc']['img_s'] / med['dpex-shm']['img_s']:.2f}")


if __name__ == "__main__":
    main()
