"""A trainer's gaps between batches while strangers flood its worker's data
port: an epoch over the network path (no /dev/shm) alone, then beside 1,000
hostile connections (half send 16 random bytes as a key, half say nothing),
side by side in one run; then the first batch of a new stream (a trainer
that pairs its data socket) while 1,100 sockets that sent random keys stay open.

    .venv/bin/python benchmarks/dataport_flood.py [--rounds 3] [--connections 1000]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402

SPEC = dpex.DatasetSpec("dpex.testing.datasets:Sized", 1000, (1, 2))  # 1 and 2 MiB frames


def epoch(loader) -> tuple[float, float, float]:
    """(seconds, median gap, worst gap) between batches."""
    start = last = time.perf_counter()
    gaps = []
    for _ in loader:
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return time.perf_counter() - start, statistics.median(gaps), max(gaps)


def flood(port: int, connections: int, stop: threading.Event) -> int:
    """Opens ``connections`` hostile sockets to the port (in waves of 100); how many it made."""
    made = 0
    while made < connections and not stop.is_set():
        wave = []
        for i in range(min(100, connections - made)):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                continue
            if i % 2 == 0:
                s.sendall(os.urandom(16))
            wave.append(s)
        made += len(wave)
        time.sleep(0.05)
        for s in wave:
            s.close()
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--connections", type=int, default=1000)
    args = p.parse_args()
    alone, flooded, made = [], [], []
    with dpex.LocalCluster(num_workers=1, processes=1) as cluster:
        with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
            epoch(dl)  # warm up
            port = next(iter(dl._session.streams._streams.values()))._sock.getpeername()[1]
            for _ in range(args.rounds):
                alone.append(epoch(dl))
                stop = threading.Event()
                out: list[int] = []
                attacker = threading.Thread(target=lambda: out.append(flood(port, args.connections, stop)))
                attacker.start()
                flooded.append(epoch(dl))
                stop.set()
                attacker.join()
                made.append(out[0])
            held = []
            for _ in range(1100):
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                    s.sendall(os.urandom(16))
                    held.append(s)
                except OSError:
                    pass
            dl._session.streams.close()  # the next epoch pairs a new data socket, strangers still connected
            start = time.perf_counter()
            it = iter(dl)
            next(it)
            pairing = time.perf_counter() - start
            for _ in it:
                pass
            for s in held:
                s.close()
    med = statistics.median
    print(f"data port flood beside a trainer (network path, 1-2 MiB frames, 1,000 batches), median of {args.rounds}; "
          f"hostile connections made during each flooded epoch: {made}")
    print(f"{'':22}{'epoch':>9}{'median gap':>12}{'worst gap':>11}")
    for name, runs in (("alone", alone), ("beside the flood", flooded)):
        print(f"{name:22}{med(r[0] for r in runs):>8.2f}s{med(r[1] for r in runs) * 1e3:>10.1f}ms"
              f"{med(r[2] for r in runs) * 1e3:>9.1f}ms")
    print(f"worst gap, flooded / alone: {med(r[2] for r in flooded) / med(r[2] for r in alone):.2f}; "
          f"flooded worst / alone median gap: {med(r[2] for r in flooded) / med(r[1] for r in alone):.1f}")
    print(f"first batch of a new stream with 1,100 random-key sockets open: {pairing:.2f}s")


if __name__ == "__main__":
    main()
