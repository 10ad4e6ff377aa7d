"""Workers that follow what a trainer needs, on a Ray cluster built on this
machine whose autoscaler adds and removes nodes (Ray's fake multi-node
provider, dpex.testing.rayscale), with an I/O-bound dataset so that two
cores suffice: how fast a waiting trainer gets its workers, its rate then
against a static run with as many workers, how fast a pause gives them
back and a resume takes them again, and how often the number changes under
a steady load.

    .venv/bin/python benchmarks/autoscale.py [--pause 60] [--cooldown 20]

The trainer reads ``--samples`` samples of 10 ms each (one worker process
per worker) and does nothing else, so it waits until 3 workers serve.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--delay", type=float, default=0.01, help="seconds per sample (a remote read)")
    p.add_argument("--pause", type=float, default=60.0, help="seconds the trainer stops mid-epoch")
    p.add_argument("--cooldown", type=float, default=20.0, help="the policy's --scale-cooldown")
    p.add_argument("--max-workers", type=int, default=3)
    args = p.parse_args()

    import dpex
    import dpex.ray
    from dpex.proto import dispatcher_pb2 as dpb
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.rpc import call, channel
    from dpex.testing.rayscale import FakeAutoscalingCluster

    spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", args.samples, args.delay)
    flags = dict(dispatcher_flags=("--heartbeat-interval", "0.5", "--heartbeat-timeout", "3"),
                 worker_flags=("--heartbeat-interval", "0.5"))

    def run(min_workers: int, max_workers: int, pause_at: int | None = None) -> dict:
        """One epoch on a fresh cluster: its rate, the number of workers serving over time, the batches."""
        with FakeAutoscalingCluster(node_cpus=1, max_nodes=max_workers + 1) as cluster:
            config = dpex.ray.RayConfig(min_workers=min_workers, max_workers=max_workers, worker_cpus=1,
                                        scale_cooldown_s=args.cooldown, **flags)
            endpoint = dpex.ray.start(cluster.address, config, wait_s=300)
            stub = dgrpc.DispatcherStub(channel(endpoint.address, endpoint.auth_token))
            timeline: list[tuple[float, int, int]] = []  # (seconds, serving, wanted)
            done, t0 = threading.Event(), time.monotonic()

            def watch() -> None:
                while not done.wait(0.5):
                    status = call(stub.GetStatus, dpb.GetStatusRequest(), target="dispatcher", timeout_s=10)
                    timeline.append((time.monotonic() - t0, sum(w.state == "alive" for w in status.workers),
                                     status.workers_wanted))
            watcher = threading.Thread(target=watch)
            watcher.start()
            got, events, times = [], {}, []
            try:
                with dpex.RemoteDataLoader(endpoint.address, spec, batch_size=10, auth_token=endpoint.auth_token,
                                           timeout=600) as loader:
                    start = time.monotonic()
                    for batch in loader:
                        got.extend(int(y) for y in batch["y"])
                        times.append(time.monotonic() - t0)
                        if pause_at is not None and len(got) == pause_at:
                            events["paused"] = time.monotonic() - t0
                            time.sleep(args.pause)  # an evaluation: the loop reads nothing
                            events["resumed"] = time.monotonic() - t0
                    elapsed = time.monotonic() - start - (args.pause if pause_at is not None else 0)
                events["ended"] = time.monotonic() - t0
                time.sleep(args.cooldown + 10)  # the workers given back after the epoch
            finally:
                done.set()
                watcher.join()
                dpex.ray.stop(cluster.address)
            return dict(rate=len(got) / elapsed, times=times, timeline=timeline, events=events, exact=got == list(range(len(got)))
                        and len(got) == args.samples)

    def first(timeline, after: float, condition) -> float | None:
        return next((t - after for t, serving, wanted in timeline if t >= after and condition(serving, wanted)), None)

    static = run(args.max_workers, args.max_workers)
    scaled = run(1, args.max_workers, pause_at=args.samples // 2)
    timeline, events = scaled["timeline"], scaled["events"]
    up = first(timeline, 0.0, lambda s, w: s >= args.max_workers)
    down = first(timeline, events["paused"], lambda s, w: s == 1)
    again = first(timeline, events["resumed"], lambda s, w: s >= 2)
    # Flapping: changes of the number wanted while the load was steady (the first half, once up).
    steady = [w for t, s, w in timeline if up is not None and up + 5 <= t <= events["paused"]]
    changes = sum(a != b for a, b in zip(steady, steady[1:]))
    span = (events["paused"] - up - 5) if up is not None else 0.0

    def fmt(value) -> str:
        return "-" if value is None else f"{value:.1f}"
    print(f"\nan I/O-bound trainer ({args.samples} samples of {args.delay * 1000:g} ms, batch 10); "
          f"min_workers 1, max_workers {args.max_workers}, cool-down {args.cooldown:g} s, pause {args.pause:g} s")
    print(f"{'figure':60s} {'value':>10s}")
    print(f"{'from 1 worker to ' + str(args.max_workers) + ' serving, s (target <= 30)':60s} {fmt(up):>10s}")
    batch = args.samples / len(scaled["times"])
    served = [t for t in scaled["times"] if up is not None and up <= t <= events["paused"]]
    rate_up = len(served) * batch / (events["paused"] - up) if served else 0.0
    print(f"{'rate once ' + str(args.max_workers) + ' serve / a static ' + str(args.max_workers) + '-worker run':60s} "
          f"{rate_up / static['rate']:10.2f}")
    print(f"{'paused: back to 1 worker, s (target <= cool-down + 10)':60s} {fmt(down):>10s}")
    print(f"{'resumed: 2 or more serving again, s':60s} {fmt(again):>10s}")
    print(f"{'every batch exactly once, in order (static, scaled)':60s} {str(static['exact']):>5s} "
          f"{str(scaled['exact']):>4s}")
    print(f"{'changes of the number wanted per cool-down, steady load':60s} "
          f"{changes / max(span / args.cooldown, 1e-9):10.2f}")
    print("\ntimeline (s: serving/wanted): " + " ".join(f"{t:.0f}:{s}/{w}" for t, s, w in timeline[::4]))


if __name__ == "__main__":
    main()
