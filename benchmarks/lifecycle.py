"""How long the cluster's lifecycle takes, as a user meets it:

    .venv/bin/python benchmarks/lifecycle.py [--runs 3]

- embedded cluster start: `DpexDataLoader(..., distribute_mode=True,
  num_workers=N)` built (dispatcher + a worker of N processes serving) and
  its first batch, for N = 1 and 10, beside a torch DataLoader's first batch;
- `close()` of that loader, and a trainer process that exits without `close()`;
- Ctrl-C (SIGINT) of a trainer mid-epoch on an embedded cluster, to its exit;
- SIGTERM of a worker while a 25 s batch runs, to its exit (`--drain-timeout 2`);
- a dispatcher back after an outage of 12 s: until both workers are registered.

Medians of the runs (worst in brackets). Timings on this machine only: each
figure comes with the same-run torch figure where one applies.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import dpex  # noqa: E402
from dpex.proto import dispatcher_pb2 as dpb  # noqa: E402
from dpex.proto import dispatcher_pb2_grpc as dgrpc  # noqa: E402
from dpex.rpc import call, channel  # noqa: E402
from dpex.testing import test_cluster, wait_until  # noqa: E402
from dpex.testing.datasets import Squares  # noqa: E402

TRAINER = """
import os, signal, sys, time
from dpex import DpexDataLoader
from dpex.testing.datasets import Slow
loader = DpexDataLoader(Slow(10_000, delay_s=0.01), distribute_mode=True, batch_size=8, num_workers=2)
it = iter(loader)
next(it)
print("ready", flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)  # leaves without close(): the finalizers run
for batch in it:
    pass
"""


def timed(fn) -> float:
    start = time.monotonic()
    fn()
    return time.monotonic() - start


def embedded(num_workers: int) -> tuple[float, float, float, float]:
    """(built, built + first batch, close, torch's first batch) for one run."""
    start = time.monotonic()
    loader = dpex.DpexDataLoader(Squares(64), distribute_mode=True, batch_size=8, num_workers=num_workers)
    built = time.monotonic() - start
    next(iter(loader))
    started = time.monotonic() - start
    closed = timed(loader.close)
    torch_loader = DataLoader(Squares(64), batch_size=8, num_workers=num_workers)
    first_torch = timed(lambda: next(iter(torch_loader)))
    return built, started, closed, first_torch


def trainer(how: str) -> float:
    """Seconds from the trainer's SIGINT (or from its last line) to its exit."""
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, how], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().strip() == "ready"
    start = time.monotonic()
    if how == "sigint":
        proc.send_signal(signal.SIGINT)
    proc.wait(120)
    return time.monotonic() - start


def drain() -> float:
    with tempfile.TemporaryDirectory() as tmp, test_cluster(num_workers=2, heartbeat_timeout_s=60.0) as c:
        flag = os.path.join(tmp, "slow")
        open(flag, "w").close()
        spec = dpex.DatasetSpec("dpex.testing.datasets:SlowWhile", n=200, path=flag, delay_s=0.5)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=50, timeout=120) as loader:
            it = iter(loader)

            def running() -> int | None:  # 1 + the index of a worker running a batch
                with channel(c.address) as ch:
                    status = dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=5)
                busy = {w.address for w in status.workers if w.load.running_batches}
                return next((i + 1 for i, w in enumerate(c.workers) if w.address in busy), None)
            index = wait_until(running, 60, "a running batch") - 1
            took = timed(lambda: c.kill_worker(index, signal.SIGTERM))
            os.unlink(flag)
            list(it)
        return took


def reconnect(outage_s: float = 12.0) -> float:
    with test_cluster(num_workers=2) as c:
        c.stop_dispatcher()
        time.sleep(outage_s)  # the outage being measured, not a wait for a condition
        c.start_dispatcher()
        back = time.monotonic()

        def registered() -> bool:
            with channel(c.address) as ch:
                status = call(dgrpc.DispatcherStub(ch).GetStatus, dpb.GetStatusRequest(), target="dispatcher",
                              timeout_s=5, retry_for_s=5)
            return sum(w.state == "alive" for w in status.workers) == 2
        wait_until(registered, 120, "the workers to register again")
        return time.monotonic() - back


def show(name: str, values: list[float], extra: str = "") -> None:
    print(f"{name:52s} {statistics.median(values):6.2f} s  [{max(values):.2f}]  {extra}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"{os.cpu_count()} cores; {args.runs} runs each")
    for n in (1, 10):
        runs = [embedded(n) for _ in range(args.runs)]
        show(f"embedded cluster, num_workers={n}: loader built", [r[0] for r in runs])
        show(f"embedded cluster, num_workers={n}: built + first batch", [r[1] for r in runs],
             f"(torch DataLoader first batch: {statistics.median(r[3] for r in runs):.2f} s)")
        show(f"embedded cluster, num_workers={n}: close()", [r[2] for r in runs])
    show("trainer exits without close()", [trainer("exit") for _ in range(args.runs)])
    show("trainer mid-epoch: Ctrl-C to exit", [trainer("sigint") for _ in range(args.runs)])
    show("worker SIGTERM with a 25 s batch running (drain 2 s)", [drain() for _ in range(args.runs)])
    show("dispatcher back after a 12 s outage: workers registered", [reconnect() for _ in range(args.runs)])


if __name__ == "__main__":
    main()
