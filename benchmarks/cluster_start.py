"""How long a LocalCluster of a dispatcher and two workers takes to serve, and
the CPU its daemons spend getting there: each daemon a new interpreter (the
default) against forked from the warm starter (``warm_start=True``), started
in turn, alternating, in one run. The first warm cluster pays the starter's
own imports, once per process: reported apart.

    python benchmarks/cluster_start.py [ROUNDS]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex import LocalCluster  # noqa: E402
from dpex.testing import descendants  # noqa: E402


def _cpu(pid: int) -> float:
    """CPU seconds a live process has used (user + system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(warm: bool) -> tuple[float, float]:
    """(seconds until the cluster serves, CPU seconds its daemons and their processes used until then)."""
    began = time.perf_counter()
    cluster = LocalCluster(num_workers=2, warm_start=warm)
    serving = time.perf_counter() - began
    daemons = [cluster.dispatcher.process.pid] + [w.process.pid for w in cluster.workers]
    cpu = sum(_cpu(pid) for daemon in daemons for pid in [daemon, *descendants(daemon)])
    cluster.close()
    return serving, cpu


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    first = start(True)  # starts the starter
    cold, warm = [], []
    for _ in range(rounds):
        cold.append(start(False))
        warm.append(start(True))
    med = statistics.median
    print(f"{'LocalCluster(num_workers=2)':<48} {'serves after':>13} {'CPU until then':>15}")
    for name, runs in (("new interpreters", cold), ("warm_start=True", warm)):
        print(f"{'%s (median of %d)' % (name, rounds):<48} {med(s for s, _ in runs):>11.2f} s "
              f"{med(c for _, c in runs):>13.2f} s")
    print(f"{'warm_start=True, the first (starts the starter)':<48} {first[0]:>11.2f} s")
    print(f"ratios, warm to new interpreters: serving {med(s for s, _ in warm) / med(s for s, _ in cold):.2f}x, "
          f"CPU {med(c for _, c in warm) / med(c for _, c in cold):.2f}x")


if __name__ == "__main__":
    main()
