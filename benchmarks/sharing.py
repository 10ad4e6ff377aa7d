"""Trials of a sweep that read the same epoch, on one worker: what the
worker's CPU costs with sharing (each batch made once for all, the default)
and without (share=False), against one trial alone; whether each trial's
batches are bitwise a solo run's; how a paused trial affects the others;
how long a shared batch takes to reach a trainer beside a fresh one; and the
memory kept under many trials and a small budget; and a validation set
kept by the workers (cache="memory"): its later epochs' CPU against its
first (torchvision's validation transform: JPEG decode, resize, center crop).

    .venv/bin/python benchmarks/sharing.py [--trials 3] [--rounds 2] [--pause 30]

Samples are JPEGs decoded, random-resized-cropped and flipped with keyed
draws (benchmarks.pipeline.JpegFolder(keyed=True)). The trials run as
threads of this process, each its own loader and job; the worker is one
dpex-worker of two processes. CPU is the worker's (daemon and processes),
from /proc. Rounds alternate sharing on and off; medians.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--images", type=int, default=384)
    p.add_argument("--size", type=int, default=160, help="crop size (pixels)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--pause", type=float, default=30.0, help="seconds one trial stops mid-epoch")
    p.add_argument("--many", type=int, default=8, help="trials at once for the memory bound")
    p.add_argument("--budget-mb", type=int, default=16, help="--share-cache-bytes for the memory bound")
    p.add_argument("--val-batch-size", type=int, default=64, help="the validation set's batch size")
    p.add_argument("--val-images", type=int, default=1024, help="the validation set's JPEGs")
    p.add_argument("--data", default=".data/bench-jpegs")
    args = p.parse_args()

    import dpex
    from benchmarks.measure import cpu_s, tree
    from benchmarks.pipeline import make_jpegs
    from dpex.proto import dispatcher_pb2 as dpb
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.rpc import call, channel

    root = make_jpegs(os.path.abspath(args.data), args.images, 320)
    spec = dpex.DatasetSpec("benchmarks.pipeline:JpegFolder", root, args.size, keyed=True)

    def epoch(address: str, share: bool, pause_after: int | None = None, pause_s: float = 0.0,
              waits: list | None = None) -> tuple[list[bytes], float]:
        """One shuffled epoch: each batch's digest, and batches per second."""
        digests = []
        with dpex.RemoteDataLoader(address, spec, batch_size=args.batch_size, shuffle=True, seed=11,
                                   share=share, timeout=600) as loader:
            it = iter(loader)
            start = time.perf_counter()
            paused = 0.0
            while True:
                asked = time.perf_counter()
                try:
                    images, labels = next(it)
                except StopIteration:
                    break
                if waits is not None:
                    waits.append(time.perf_counter() - asked)
                digests.append(hashlib.sha256(images.numpy().tobytes() + labels.numpy().tobytes()).digest())
                if pause_after is not None and len(digests) == pause_after:
                    time.sleep(pause_s)  # the trial stops: its loop does something else
                    paused += pause_s
            return digests, len(digests) / (time.perf_counter() - start - paused)

    def together(runs):
        out = [None] * len(runs)
        threads = [threading.Thread(target=lambda k=k: out.__setitem__(k, runs[k]())) for k in range(len(runs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    def worker_pids(cluster) -> list[int]:
        return tree(cluster.workers[0].process.pid)

    def status(cluster):
        return call(dgrpc.DispatcherStub(channel(cluster.address)).GetStatus, dpb.GetStatusRequest(),
                    target="dispatcher", timeout_s=10)

    def shares(cluster) -> tuple[int, int]:
        load = status(cluster).workers[0].load
        return load.share_hits, load.share_misses

    cluster = dpex.LocalCluster(num_workers=1, processes=2)
    try:
        epoch(cluster.address, True)  # warm: the worker's processes have imported and built the dataset
        cpu: dict[str, list[float]] = {"1 trial": [], "shared": [], "share=False": []}
        made: list[float] = []  # batches made per batch delivered, sharing
        exact = True
        for r in range(args.rounds):
            before = cpu_s(worker_pids(cluster))
            solo, _ = epoch(cluster.address, True)
            cpu["1 trial"].append(cpu_s(worker_pids(cluster)) - before)
            for name, share in (("shared", True), ("share=False", False)) if r % 2 == 0 else \
                    (("share=False", False), ("shared", True)):
                before, counted = cpu_s(worker_pids(cluster)), shares(cluster)
                trials = together([lambda: epoch(cluster.address, share)] * args.trials)
                cpu[name].append(cpu_s(worker_pids(cluster)) - before)
                if share:
                    time.sleep(1.0)  # the worker's next heartbeat carries its counters
                    hits, misses = (now - then for now, then in zip(shares(cluster), counted))
                    made.append(misses / (hits + misses) * args.trials)
                exact &= all(digests == solo for digests, _ in trials)
            print(f"round {r + 1}: worker CPU s " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cpu.items()),
                  flush=True)
        med = {k: statistics.median(v) for k, v in cpu.items()}

        # A paused trial: the others' rate with and without it.
        free = together([lambda: epoch(cluster.address, True)] * args.trials)
        pause_at = len(free[0][0]) // 3
        paused = together([lambda: epoch(cluster.address, True, pause_at, args.pause)] +
                          [lambda: epoch(cluster.address, True)] * (args.trials - 1))
        free_rate = statistics.mean(rate for _, rate in free[1:])
        paused_rate = statistics.mean(rate for _, rate in paused[1:])

        # A shared batch's wait beside a fresh one's: the second trial stops after its first batch
        # while the first goes on, then reads what the first made.
        lead_waits: list[float] = []
        follow_waits: list[float] = []
        together([lambda: epoch(cluster.address, True, waits=lead_waits),
                  lambda: epoch(cluster.address, True, pause_after=1, pause_s=2.0, waits=follow_waits)])
        lead_ms, follow_ms = 1000 * statistics.median(lead_waits[1:]), 1000 * statistics.median(follow_waits[1:])
    finally:
        cluster.close()

    # A validation set kept by the workers: its second epoch's worker CPU against its first's.
    valid = dpex.LocalCluster(num_workers=1, processes=2)
    try:
        val_root = make_jpegs(os.path.abspath(args.data + f"-val{args.val_images}"), args.val_images, 320, seed=1)
        val_spec = dpex.DatasetSpec("benchmarks.pipeline:JpegFolder", val_root, args.size, center=True)
        val_cpu, val_children = [], []
        with dpex.RemoteDataLoader(valid.address, val_spec, batch_size=args.val_batch_size, cache="memory",
                                   timeout=600) as loader:
            for _ in range(3):
                pids = worker_pids(valid)
                before, children = cpu_s(pids), cpu_s(pids[1:])
                for _ in loader:
                    pass
                pids = worker_pids(valid)
                val_cpu.append(cpu_s(pids) - before)
                val_children.append(cpu_s(pids[1:]) - children)
    finally:
        valid.close()

    # Memory: many trials at once on a worker with a small budget.
    budget = args.budget_mb << 20
    small = dpex.LocalCluster(num_workers=1, processes=2, worker_flags=("--share-cache-bytes", str(budget)))
    try:
        peak = [0]
        done = threading.Event()

        def watch():
            while not done.wait(0.1):
                peak[0] = max(peak[0], max((w.load.share_bytes for w in status(small).workers), default=0))
        watcher = threading.Thread(target=watch)
        watcher.start()
        many = together([lambda: epoch(small.address, True)] * args.many)
        done.set()
        watcher.join()
        exact &= len({tuple(d) for d, _ in many}) == 1
    finally:
        small.close()

    print(f"\n{args.trials} trials of one shuffled epoch ({args.images} JPEGs, crop {args.size}, batch "
          f"{args.batch_size}), one worker of 2 processes; medians of {args.rounds} rounds")
    print(f"{'figure':60s} {'value':>10s}")
    print(f"{'worker CPU, ' + str(args.trials) + ' trials shared / 1 trial':60s} {med['shared'] / med['1 trial']:10.2f}")
    print(f"{'worker CPU, ' + str(args.trials) + ' trials share=False / 1 trial':60s} "
          f"{med['share=False'] / med['1 trial']:10.2f}")
    print(f"{'  each batch made, times (1: once for all trials)':60s} {statistics.median(made):10.2f}")
    print(f"{'every trial bitwise equal to a solo run':60s} {str(exact):>10s}")
    print(f"{'others rate with a trial paused ' + format(args.pause, 'g') + ' s / without':60s} "
          f"{paused_rate / free_rate:10.2f}")
    print(f"{'wait for a batch (ms): a trial behind, shared / the trial ahead':60s} {follow_ms:4.1f} / {lead_ms:.1f}")
    print(f"{'bytes kept, ' + str(args.many) + ' trials, peak / budget':60s} {peak[0] / budget:10.2f}")
    print(f"{'validation set, cache=memory (batch ' + str(args.val_batch_size) + '): worker CPU, epoch 2 / 1':60s} "
          f"{val_cpu[1] / val_cpu[0]:10.2f}")
    print(f"{'  epoch 3 / epoch 1':60s} {val_cpu[2] / val_cpu[0]:10.2f}")
    print(f"{'  its batch processes alone, epoch 2 / 1':60s} {val_children[1] / val_children[0]:10.2f}")


if __name__ == "__main__":
    main()
