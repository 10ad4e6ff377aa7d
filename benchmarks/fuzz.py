"""The fuzzer on every port of a local cluster (dpex.testing.fuzz): the
dispatcher's and the worker's gRPC methods, the worker's data port, the
metrics port's HTTP, and the trainer's frame decoder; after each port, a
real job must still get every batch.

    .venv/bin/python benchmarks/fuzz.py [--inputs 100000] [--seed 0] [--ports dispatcher,worker,data,http,frames]

Prints a table (inputs, unhandled, hangs, crashes, a job after, the outcomes)
and exits non-zero if any port found something.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing.fuzz import PORTS, run_fuzz  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inputs", type=int, default=100_000, help="inputs per port")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ports", default=",".join(PORTS))
    args = p.parse_args()
    reports = run_fuzz(inputs=args.inputs, seed=args.seed, ports=tuple(args.ports.split(",")))
    print("| port | inputs | unhandled | hangs | crashes | a real job after | s | outcomes |")
    print("|---|---|---|---|---|---|---|---|")
    for r in reports:
        outcomes = ", ".join(f"{k} {v}" for k, v in r.outcomes.most_common())
        print(f"| {r.port} | {r.inputs} | {r.unhandled_count} | {r.hangs} | {r.crashes} | {r.job_after} | "
              f"{r.seconds:.0f} | {outcomes} |")
    for r in reports:
        for u in r.unhandled:
            print(f"{r.port}: {u}")
    sys.exit(0 if all(r.ok for r in reports) else 1)
