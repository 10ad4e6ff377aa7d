"""A seeded chaos run on a LocalCluster: random worker kills, worker restarts
on the same address, frozen workers (a cut link, thawed later), dispatcher
kill -9 + restart from its journal, and workers joining — all mid-epoch.
It counts, per batch id, what arrived: lost and duplicated must be 0."""
from __future__ import annotations

import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import dpex
from dpex.testing.cluster import test_cluster

EVENTS = ("kill_worker", "restart_worker", "freeze_worker", "restart_dispatcher", "add_worker")


@dataclass
class ChaosReport:
    planned: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0
    events: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    def __str__(self) -> str:
        events = ", ".join(f"{k} {v}" for k, v in sorted(self.events.items()))
        return (f"batches planned {self.planned}, delivered {self.delivered}, lost {self.lost}, "
                f"duplicated {self.duplicated}; events: {events}; {self.seconds:.1f}s")


def run_chaos(seed: int = 0, epochs: int = 4, samples: int = 480, batch_size: int = 4,
              events_per_epoch: int = 4, workers: int = 3) -> ChaosReport:
    rng = random.Random(seed)
    report = ChaosReport()
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work_dir, \
            test_cluster(num_workers=workers, work_dir=work_dir) as cluster:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=samples, delay_s=0.002)
        with dpex.RemoteDataLoader(cluster.address, spec, batch_size=batch_size, shuffle=True, seed=seed,
                                   timeout=120) as loader:
            for _ in range(epochs):
                num = len(loader)
                at = dict.fromkeys(sorted(rng.sample(range(1, num - 1), events_per_epoch)))
                frozen: list[tuple[int, object]] = []  # (thaw at batch, daemon)
                seen: Counter = Counter()
                for i, batch in enumerate(loader):
                    seen[tuple(batch["y"].tolist())] += 1
                    for thaw_at, daemon in [f for f in frozen if f[0] <= i]:
                        daemon.process.send_signal(signal.SIGCONT)
                        frozen.remove((thaw_at, daemon))
                    if i in at:
                        _event(rng.choice(EVENTS), cluster, rng, frozen, i, report)
                for _, daemon in frozen:
                    daemon.process.send_signal(signal.SIGCONT)
                report.planned += num
                report.delivered += sum(seen.values())
                report.duplicated += sum(c - 1 for c in seen.values())
                report.lost += num - len(seen)
    report.seconds = time.monotonic() - start
    return report


def _event(kind: str, cluster, rng: random.Random, frozen: list, i: int, report: ChaosReport) -> None:
    running = [k for k, w in enumerate(cluster.workers) if w.process.poll() is None
               and all(w is not d for _, d in frozen)]
    if kind in ("kill_worker", "freeze_worker") and len(running) < 2:
        kind = "add_worker"  # keep one worker serving
    report.events[kind] += 1
    if kind == "kill_worker":
        cluster.kill_worker(rng.choice(running))
    elif kind == "restart_worker":
        cluster.restart_worker(rng.choice(running))
    elif kind == "freeze_worker":
        daemon = cluster.workers[rng.choice(running)]
        daemon.process.send_signal(signal.SIGSTOP)
        frozen.append((i + rng.randint(5, 30), daemon))
    elif kind == "restart_dispatcher":
        cluster.restart_dispatcher()
    else:
        cluster.add_workers(1)
