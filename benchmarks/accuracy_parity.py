"""Accuracy parity: the digits CNN of examples/train_digits.py trained with
distribute_mode=False (torch's DataLoader) and True (Dpex workers), for one
process, nn.DataParallel and DDP with 2 ranks (torchrun, gloo). Same seeds,
so the same batches: the loss curves must agree to float rounding.

    .venv/bin/python benchmarks/accuracy_parity.py [--epochs 3]

Prints a table (final loss, test accuracy, batches per epoch per rank) and,
per setting, the largest absolute difference between the two loss curves.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import dpex  # noqa: E402

SCRIPT = os.path.join(ROOT, "examples", "train_digits.py")
BIN = os.path.dirname(sys.executable)


def run(setting: str, distribute: bool, epochs: int, out: str, env: dict) -> list[dict]:
    args = ["--mode", setting, "--epochs", str(epochs), "--out", out] + (["--distribute"] if distribute else [])
    if setting == "ddp":
        cmd = [os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node=2", SCRIPT, *args]
    else:
        cmd = [sys.executable, SCRIPT, *args]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    paths = [f"{out}.rank{r}" for r in range(2)] if setting == "ddp" else [out]
    return [json.load(open(p)) for p in paths]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    rows, diffs = [], {}
    with dpex.LocalCluster(num_workers=1, processes=2) as cluster, tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "DPEX_DISPATCHER": cluster.address, "OMP_NUM_THREADS": "1"}
        for setting in ("single", "dp", "ddp"):
            results = {}
            for distribute in (False, True):
                ranks = run(setting, distribute, args.epochs, os.path.join(tmp, f"{setting}-{distribute}.json"), env)
                results[distribute] = ranks
                for r in ranks:
                    rows.append((setting, "True" if distribute else "False", r["rank"], r["losses"][-1],
                                 r["accuracy"], "/".join(str(len(e)) for e in r["seen"])))
            same_batches = all(a["seen"] == b["seen"] for a, b in zip(results[False], results[True]))
            diffs[setting] = (max(abs(x - y) for a, b in zip(results[False], results[True])
                                  for x, y in zip(a["losses"], b["losses"])), same_batches)
    print(f"digits CNN, {args.epochs} epochs, batch 32, SGD lr 0.1 momentum 0.9, seed 0\n")
    print("| setting | distribute_mode | rank | final loss | test accuracy | batches per epoch |")
    print("|---|---|---|---|---|---|")
    for s, d, r, loss, acc, batches in rows:
        print(f"| {s} | {d} | {r} | {loss:.6f} | {acc:.4f} | {batches} |")
    print("\n| setting | max abs loss difference (True vs False) | same batches |")
    print("|---|---|---|")
    for s, (diff, same) in diffs.items():
        print(f"| {s} | {diff:.3g} | {same} |")


if __name__ == "__main__":
    main()
