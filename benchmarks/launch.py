"""How long a trainer waits before its first batch, by where loading runs:
an embedded local cluster, and a Ray cluster (three nodes built on this
machine by ray.cluster_utils) where DpexDataLoader(head_address="auto")
first starts Dpex's actors and then finds them by name. One run, side by side.

    python benchmarks/launch.py
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

RAY_DIR = tempfile.mkdtemp(prefix="ray-")
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=RAY_DIR)  # loopback only

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import shutil  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

ROUNDS = 3


def first_batch(head_address: str | None = "auto") -> float:
    start = time.perf_counter()
    with DpexDataLoader(list(range(64)), distribute_mode=True, head_address=head_address, batch_size=8) as dl:
        next(iter(dl))
        return time.perf_counter() - start


def main() -> None:
    from ray.cluster_utils import Cluster

    import dpex.ray
    embedded = [first_batch() for _ in range(ROUNDS)]  # no Ray running yet: "auto" is embedded
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, include_dashboard=False))
    try:
        for _ in range(2):
            cluster.add_node(num_cpus=1)
        start = first_batch()  # "auto" finds the Ray node, starts the dispatcher and 3 workers
        found = [first_batch() for _ in range(ROUNDS)]  # the actors are there: found by name
    finally:
        dpex.ray.stop(cluster.address)
        cluster.shutdown()
        shutil.rmtree(RAY_DIR, ignore_errors=True)
    med = statistics.median
    print(f"{'where loading runs':<52} {'first batch after':>18}")
    print(f"{'embedded local cluster (median of %d)' % ROUNDS:<52} {med(embedded):>16.2f} s")
    print(f"{'Ray, 3 nodes: Dpex started on it by the loader':<52} {start:>16.2f} s")
    print(f"{'Ray, 3 nodes: Dpex found by name (median of %d)' % ROUNDS:<52} {med(found):>16.2f} s")
    print(f"ratios to the embedded cluster: started {start / med(embedded):.2f}x, found {med(found) / med(embedded):.2f}x")


if __name__ == "__main__":
    main()
