"""The chaos campaign: N seeded runs of dpex.testing.chaos (a 3-rank DDP job of
trainer processes on a local cluster, faults at random steps, every sample
compared bitwise with an uninterrupted run of the same seed), and its table.

    .venv/bin/python benchmarks/chaos.py [--runs 200] [--seed 0] [--events 6] [--epochs 3] [--full-disk] [--hosts]

--full-disk (root, util-linux's unshare): the dispatcher's journal on a 4 MB
tmpfs of the run's own mount namespace, and full_disk among the faults.
--hosts (root, ip netns): the dispatcher, each worker and the trainers on
hosts of their own (network namespaces), and cut_worker among the faults (a
worker's host cut off the network and healed).

Exits non-zero if any run lost, duplicated or changed a sample, stalled past
its limit or failed.
"""
import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing import mounts  # noqa: E402
from dpex.testing.chaos import EVENTS, ChaosReport, Job, run_chaos  # noqa: E402

TMPFS_ENV = "DPEX_CHAOS_JOURNAL_TMPFS"  # set inside the mount namespace: where the tmpfs is


def table(total: ChaosReport, stalls: list[float]) -> str:
    rows = [("runs", total.runs), ("samples checked", total.samples), ("lost", total.lost),
            ("duplicated", total.duplicated), ("not bitwise equal", total.unequal),
            ("repeats from elastic padding (allowed)", total.padding),
            ("restarts after a rank raised torch's words (a batch process killed mid-batch)", total.raised),
            ("failed or hung runs", len(total.failures)),
            ("longest stall", f"{total.stall_s:.1f} s"),
            ("median run's longest stall", f"{sorted(stalls)[len(stalls) // 2]:.1f} s" if stalls else "-"),
            ("time", f"{total.seconds / 60:.1f} min")]
    out = ["| figure | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    out += ["", "| fault | injected | slowest recovery (to the next step done) |", "|---|---|---|"]
    out += [f"| {kind} | {total.events.get(kind, 0)} | "
            f"{total.recovery_s[kind]:.1f} s |" if kind in total.recovery_s else
            f"| {kind} | {total.events.get(kind, 0)} | - |" for kind in (*EVENTS, "full_disk", "cut_worker")]
    return "\n".join(out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="the first run's seed; run k has seed + k")
    p.add_argument("--events", type=int, default=6, help="faults a run")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--full-disk", action="store_true", help="the journal on a small tmpfs, full at times")
    p.add_argument("--hosts", action="store_true", help="hosts of their own (network namespaces), links cut")
    args = p.parse_args()
    journal_dir = os.environ.get(TMPFS_ENV)
    if args.full_disk and not journal_dir:
        if not mounts.available():
            sys.exit("--full-disk needs root and util-linux's unshare (a mount namespace)")
        import tempfile
        journal_dir = tempfile.mkdtemp(prefix="chaos-journal-")
        os.environ[TMPFS_ENV] = journal_dir
        mounts.exec_with_tmpfs(journal_dir, "4m", [sys.executable, *sys.argv])
    total, stalls, kinds = ChaosReport(), [], Counter()
    for k in range(args.runs):
        report = run_chaos(seed=args.seed + k, events=args.events, job=Job(args.seed + k, epochs=args.epochs),
                           journal_dir=journal_dir, hosts=args.hosts)
        print(f"seed {args.seed + k}: {report}", flush=True)
        for failure in report.failures:
            print("   ", failure.strip().replace("\n", "\n    "), flush=True)
        total, stalls = total + report, stalls + [report.stall_s]
    print()
    print(table(total, stalls))
    sys.exit(0 if total.ok else 1)
