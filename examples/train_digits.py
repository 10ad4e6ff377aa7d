"""Train a small CNN on scikit-learn's 8x8 digits with DpexDataLoader — the
scenarios of the original Dpex: one process, nn.DataParallel, and DDP.

    python examples/train_digits.py --mode single [--distribute]
    python examples/train_digits.py --mode dp [--distribute]
    torchrun --nproc_per_node=2 examples/train_digits.py --mode ddp [--distribute]
    python examples/train_digits.py --distribute --checkpoint ckpt.pt [--checkpoint-every 10]

The only difference between the two data paths is the `distribute_mode` flag.
With --distribute, loading runs on Dpex workers: at $DPEX_DISPATCHER if set,
otherwise on an embedded local cluster. --bug swaps in the original project's
BugDataset, whose __getitem__ divides by zero; --augment a random augmentation
(reproducible with Dpex whatever the workers). --out writes the per-step
losses, the batches each rank saw, the test accuracy and a digest of the
final parameters as JSON.

--checkpoint PATH (with --distribute) saves the model, the optimizer, the
loader's state and torch's RNG every --checkpoint-every steps (each DDP rank
to PATH.rank<r>) and, when PATH is there, resumes from it: mid-epoch, the
loader yields the batches the interrupted run had not trained on, so the
final parameters are bitwise those of an uninterrupted run. A DDP run may
resume with another number of ranks: each rank is given every saved rank's
loader state. --kill-after N SIGKILLs the run after step N (a preemption).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import signal

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from dpex import DpexDataLoader


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as ``sklearn.datasets.load_digits(return_X_y=True)``
    gives them, read from the file scikit-learn ships: importing
    sklearn.datasets (scipy and every loader) costs 1.6 s of CPU in each process."""
    sklearn = os.path.dirname(importlib.util.find_spec("sklearn").origin)
    data = np.loadtxt(os.path.join(sklearn, "datasets", "data", "digits.csv.gz"), delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


class Digits(Dataset):
    """scikit-learn's digits, 8x8 grey images; the first 1500 train, the rest test."""

    def __init__(self, train: bool) -> None:
        x, y = load_digits()
        part = slice(0, 1500) if train else slice(1500, None)
        self.x = torch.tensor(x[part], dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        self.y = torch.tensor(y[part])

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class AugmentedDigits(Digits):
    """Digits with a random augmentation drawn from torch, numpy and random: a
    shift of up to one pixel, noise, and a flip of the brightness. With Dpex
    the draws are keyed by each sample's place in the epoch, so a run is
    reproducible whatever the workers (and through kills and resumes)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        import random
        x, y, i = super().__getitem__(i)
        dy, dx = torch.randint(-1, 2, (2,)).tolist()
        x = torch.roll(x, shifts=(dy, dx), dims=(1, 2))
        x = x + torch.from_numpy(np.random.normal(0, 0.05, x.shape).astype(np.float32))
        if random.random() < 0.1:
            x = 1.0 - x
        return x, y, i


class BugDataset(Digits):
    def __getitem__(self, i: int):
        return 1 / 0


def model() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 16, 10))


def save(path: str, checkpoint: dict) -> None:
    """Writes the checkpoint whole or not at all (a kill mid-write keeps the last one)."""
    torch.save(checkpoint, path + ".tmp")
    os.replace(path + ".tmp", path)


def saved_checkpoints(path: str, ddp: bool) -> list[str]:
    """The checkpoint files of the run to resume: PATH, or every rank's PATH.rank<r>, in rank order."""
    if not ddp:
        return [path] if os.path.exists(path) else []
    ranks = [p for p in glob.glob(glob.escape(path) + ".rank*") if p.rsplit(".rank", 1)[1].isdigit()]
    return sorted(ranks, key=lambda p: int(p.rsplit(".rank", 1)[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["single", "dp", "ddp"], default="single")
    p.add_argument("--distribute", action="store_true", help="load on Dpex workers")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--num-workers", type=int, default=1)
    p.add_argument("--bug", action="store_true", help="use the BugDataset")
    p.add_argument("--augment", action="store_true", help="a random augmentation of the training samples")
    p.add_argument("--out", default=None)
    p.add_argument("--checkpoint", default=None, metavar="PATH", help="save to / resume from PATH")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="K", help="steps between checkpoints")
    p.add_argument("--kill-after", type=int, default=None, metavar="N", help="SIGKILL this run after step N")
    args = p.parse_args()
    if args.checkpoint and not args.distribute:
        p.error("--checkpoint needs --distribute (torch's DataLoader has no state_dict to resume from)")

    ddp = args.mode == "ddp"
    rank, world = 0, 1
    if ddp:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    net = bare = model().to(device)  # bare: the model without its DataParallel/DDP wrapper, to save
    if args.mode == "dp":
        net = nn.DataParallel(net)
    elif ddp:
        net = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    train_set = BugDataset(True) if args.bug else AugmentedDigits(True) if args.augment else Digits(True)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0) if ddp else None
    loader = DpexDataLoader(train_set, distribute_mode=args.distribute, batch_size=args.batch_size,
                            shuffle=sampler is None, sampler=sampler, num_workers=args.num_workers,
                            generator=torch.Generator().manual_seed(0),
                            pin_memory=device.type == "cuda")
    losses, seen, step, start = [], [], 0, 0
    mine = f"{args.checkpoint}.rank{rank}" if ddp else args.checkpoint
    saved = saved_checkpoints(args.checkpoint, ddp) if args.checkpoint else []
    if saved:
        ckpts = [torch.load(path, weights_only=False) for path in saved]
        ckpt = ckpts[rank] if rank < len(ckpts) else ckpts[0]
        bare.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict([c["loader"] for c in ckpts])  # one rank's, or all for a new world size
        torch.set_rng_state(ckpt["rng"])
        losses, seen, step, start = ckpt["losses"], ckpt["seen"], ckpt["step"], ckpt["epoch"]
        print(f"rank {rank}: resumed from step {step} (epoch {start})", flush=True)
    for epoch in range(start, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        net.train()
        if len(seen) == epoch:
            seen.append([])
        ids = seen[epoch]
        for x, y, i in loader:  # a resumed epoch: the batches the interrupted run had not trained on
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            ids.append(i.tolist())
            step += 1
            if args.checkpoint and step % args.checkpoint_every == 0:
                save(mine, {"model": bare.state_dict(),
                            "optimizer": opt.state_dict(), "loader": loader.state_dict(),
                            "rng": torch.get_rng_state(), "losses": losses, "seen": seen, "step": step,
                            "epoch": epoch})
            if step == args.kill_after:
                print(f"rank {rank}: killed after step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        print(f"rank {rank} epoch {epoch}: {len(ids)} batches, last loss {losses[-1]:.4f}", flush=True)

    net.eval()
    test = DpexDataLoader(Digits(False), distribute_mode=args.distribute, batch_size=256)
    correct = total = 0
    with torch.no_grad():
        for x, y, _ in test:
            correct += (net(x.to(device)).argmax(1).cpu() == y).sum().item()
            total += len(y)
    accuracy = correct / total
    print(f"rank {rank}: test accuracy {accuracy:.4f}, final loss {losses[-1]:.4f}", flush=True)
    if args.out:
        path = args.out if not ddp else f"{args.out}.rank{rank}"
        params = hashlib.sha256(b"".join(t.detach().cpu().numpy().tobytes()
                                         for t in net.state_dict().values())).hexdigest()
        with open(path, "w") as f:
            json.dump({"rank": rank, "world": world, "losses": losses, "seen": seen, "accuracy": accuracy,
                       "params": params}, f)
    for l in (loader, test):
        if hasattr(l, "close"):
            l.close()
    if ddp:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
