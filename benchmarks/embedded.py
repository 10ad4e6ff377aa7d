"""What an embedded cluster costs a user of DpexDataLoader(distribute_mode=True)
with no cluster anywhere: constructing the loader, its first batch, a second
loader in the same script, and close(), against torch's DataLoader with the
same ``num_workers`` (its default start method, fork on Linux, and spawn).
Dpex runs twice: by default (its embedded worker forked from the trainer, as
torch forks its workers) and with ``multiprocessing_context="spawn"`` (the
worker and its processes fresh interpreters, as before they were forked).
Every round runs in a fresh interpreter, as a script would, after
``import torch`` and ``import dpex``; "import" is the first use of
``dpex.DpexDataLoader``, which imports Dpex's client (torch's DataLoader
came with ``import torch``).

``--load N`` runs N processes that spin on the CPU throughout (a loaded
machine: parallel test runs, another job), to see that the embedded
cluster still starts, and how long it takes then.

    .venv/bin/python benchmarks/embedded.py [--rounds 5] [--num-workers 2] [--load 0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ROUND = r"""
import json, sys, time
import torch
from torch.utils.data import DataLoader
import dpex
num_workers, kind = int(sys.argv[1]), sys.argv[2]
data = [torch.full((3, 32, 32), i % 256, dtype=torch.uint8) for i in range(512)]
def make():
    if kind.startswith("dpex"):
        return dpex.DpexDataLoader(data, distribute_mode=True, batch_size=32, shuffle=True, num_workers=num_workers,
                                   multiprocessing_context="spawn" if kind == "dpex-spawn" else None)
    return DataLoader(data, batch_size=32, shuffle=True, num_workers=num_workers,
                      multiprocessing_context=None if kind == "torch" else kind)
times = {}
ti = time.perf_counter()
dpex.DpexDataLoader  # dpex's client is imported on first use (its first full gc pass after torch's import, too)
t0 = time.perf_counter()
loader = make()
t1 = time.perf_counter()
it = iter(loader)
next(it)
t2 = time.perf_counter()
for _ in it:
    pass
t3 = time.perf_counter()
second = make()           # a second loader in the same script (a validation loader)
next(iter(second))
t4 = time.perf_counter()
for closing in (second, loader):
    if hasattr(closing, "close"):
        closing.close()
t5 = time.perf_counter()
print(json.dumps(dict(import_=t0 - ti if kind.startswith("dpex") else 0.0, construct=t1 - t0, first_batch=t2 - t1, epoch=t3 - t1, second_first_batch=t4 - t3,
                      close=t5 - t4)))
"""


def one_round(num_workers: int, kind: str) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("DPEX_DISPATCHER", "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", ROUND, str(num_workers), kind], capture_output=True, text=True,
                         env=env, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--load", type=int, default=0, help="processes spinning on the CPU meanwhile")
    args = p.parse_args()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        run(args)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def run(args: argparse.Namespace) -> None:
    kinds = ["dpex", "dpex-spawn", "torch", "spawn"]
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):  # alternating, so that the machine's drift touches each alike
        for kind in kinds:
            runs[kind].append(one_round(args.num_workers, kind))
    med = {k: {m: statistics.median(r[m] for r in rs) for m in rs[0]} for k, rs in runs.items()}
    print(f"embedded cluster vs torch's DataLoader, num_workers={args.num_workers}, {os.cpu_count()} cores, "
          f"{args.load} spinning processes, "
          f"median of {args.rounds} fresh interpreters (512 samples of 3x32x32 uint8, batch 32)")
    names = {"dpex": "DpexDataLoader (embedded)", "dpex-spawn": "DpexDataLoader (spawn)",
             "torch": "torch DataLoader (fork)",
             "spawn": "torch DataLoader (spawn)"}
    metrics = ["import_", "construct", "first_batch", "epoch", "second_first_batch", "close"]
    print(f"{'':28}" + "".join(f"{m.rstrip('_'):>20}" for m in metrics))
    for kind in kinds:
        print(f"{names[kind]:28}" + "".join(f"{med[kind][m]:>19.3f}s" for m in metrics))
    for base in ("torch", "spawn", "dpex-spawn"):
        print(f"ratio dpex / {names[base]:24}" + "".join(
            f"{med['dpex'][m] / max(med[base][m], 1e-6):>19.2f}x" for m in metrics))


if __name__ == "__main__":
    main()
