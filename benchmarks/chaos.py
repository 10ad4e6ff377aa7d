"""A seeded chaos run (dpex.testing.chaos) with its tally.

    .venv/bin/python benchmarks/chaos.py [--seed 0] [--epochs 6] [--events 6]
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing.chaos import run_chaos  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--events", type=int, default=6, help="events per epoch")
    args = p.parse_args()
    report = run_chaos(seed=args.seed, epochs=args.epochs, events_per_epoch=args.events)
    print(report)
    sys.exit(0 if report.lost == report.duplicated == 0 else 1)
