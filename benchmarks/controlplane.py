"""The control plane at scale: plans, journal and dispatcher load.

    .venv/bin/python benchmarks/controlplane.py [--quick] [--huge]

- plan submission for a shuffled epoch of 10^4 .. 10^9 samples (batch 1024):
  bytes of the SubmitPlan request, seconds for `iter()` (describe + submit)
  and to the first batch, beside a torch DataLoader's first batch (up to
  10^8; torch's RandomSampler needs 36 GB of Python ints for 10^9). The
  workers' first batch of a shuffled epoch draws torch's permutation of the
  whole dataset once per epoch (O(n), as torch does): --huge runs 10^9 too;
- the work dir after 10, 100 and 1,000 short epochs (journal + snapshot);
- a dispatcher's restart (kill -9, same --work-dir) after that history:
  seconds until it serves again;
- a real dispatcher process driven over gRPC by fake workers (10, 100,
  1,000) heartbeating at the default 1 s and 256 fake consumers syncing with
  plans in work: the dispatcher's CPU (fraction of one core, including the
  setup: registering the workers, submitting the plans), the p99 of the
  heartbeats that ask for splits (there are always some to take, so they
  come back at once), how far past the 1 s long poll the others come back,
  and its RSS.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpc  # noqa: E402
import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

import dpex  # noqa: E402
from dpex.client.options import Indices  # noqa: E402
from dpex.plan import samplers  # noqa: E402
from dpex.proto import dispatcher_pb2 as dpb  # noqa: E402
from dpex.proto import dispatcher_pb2_grpc as dgrpc  # noqa: E402
from dpex.testing import test_cluster  # noqa: E402


def plans(sizes: list[int], huge_first_batch: bool) -> None:
    print("\n## plan submission, shuffled, batch 1024")
    print(f"{'samples':>14} {'request B':>10} {'iter() s':>9} {'1st batch s':>12} {'torch 1st s':>12}")
    with test_cluster(num_workers=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=60) as c:
        for n in sizes:
            spec = dpex.DatasetSpec("dpex.client.options:Indices", n)
            with dpex.RemoteDataLoader(c.address, spec, batch_size=1024, shuffle=True, timeout=600) as dl:
                torch.manual_seed(0)
                probe = tud.DataLoader(Indices(n), batch_size=1024, shuffle=True)
                iter(probe)
                request = dpb.SubmitPlanRequest(job_id=1, epoch=0, base_seed=2**62, sampler=samplers.describe(probe))
                started = time.perf_counter()
                it = iter(dl)
                submitted = time.perf_counter() - started
                first = "skipped"
                if n < 10**9 or huge_first_batch:
                    next(it)
                    first = f"{time.perf_counter() - started:.2f}"
                it.close()
            torch_first = "n/a"
            if n <= 10**8:
                started = time.perf_counter()
                next(iter(tud.DataLoader(Indices(n), batch_size=1024, shuffle=True)))
                torch_first = f"{time.perf_counter() - started:.2f}"
            print(f"{n:>14,} {request.ByteSize():>10} {submitted:>9.3f} {first:>12} {torch_first:>12}")


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def history(counts: list[int]) -> None:
    print("\n## work dir and restart after N short epochs (8 batches each, 2 workers)")
    print(f"{'epochs':>7} {'work dir KB':>12} {'restart s':>10}")
    spec = dpex.DatasetSpec("dpex.client.options:Indices", 32)
    for count in counts:
        with tempfile.TemporaryDirectory() as work:
            with test_cluster(num_workers=2, work_dir=work, heartbeat_interval_s=1.0,
                              heartbeat_timeout_s=10) as c:
                with dpex.RemoteDataLoader(c.address, spec, batch_size=4, shuffle=True, timeout=60,
                                           job_name="short") as dl:
                    for _ in range(count):
                        for _ in dl:
                            pass
                size = du(work)
                c.stop_dispatcher()  # kill -9
                started = time.perf_counter()
                c.start_dispatcher()  # returns once it serves (its ready file)
                restart = time.perf_counter() - started
            print(f"{count:>7} {size / 1024:>12.1f} {restart:>10.2f}")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


async def _load(address: str, workers: int, consumers: int, samples: int, seconds: float) -> tuple[list, int]:
    ch = grpc.aio.insecure_channel(address)
    stub = dgrpc.DispatcherStub(ch)
    job = await stub.GetOrCreateJob(dpb.GetOrCreateJobRequest(job=dpb.JobDef(
        name="load", dataset=b"x", num_consumers=consumers, batch_size=1024)))
    for k in range(consumers):
        sampler = dpb.SamplerSpec(torch_version=samplers.torch_version(), length=samples, batch_size=1024,
                                  kind=dpb.SamplerSpec.DISTRIBUTED, seed=0, num_replicas=consumers, rank=k,
                                  shuffle=True)
        await stub.SubmitPlan(dpb.SubmitPlanRequest(job_id=job.job_id, consumer_index=k, epoch=0,
                                                    sampler=sampler))
    ids = [(await stub.RegisterWorker(dpb.RegisterWorkerRequest(address=f"10.0.{i // 250}.{i % 250}:1")))
           .worker_id for i in range(workers)]
    end = time.monotonic() + seconds
    asked: list[float] = []   # heartbeats asking for splits (there are always some to take)
    overrun: list[float] = []  # the others: how far past the 1 s long poll they came back
    heartbeats = 0

    async def worker(worker_id: str) -> None:
        nonlocal heartbeats
        held: list[int] = []
        while time.monotonic() < end:
            started = time.monotonic()
            want = max(0, 2 - len(held))
            r = await stub.WorkerHeartbeat(dpb.WorkerHeartbeatRequest(
                worker_id=worker_id, want_splits=want, held_split_ids=held))
            heartbeats += 1
            took = time.monotonic() - started
            if want:
                asked.append(took)
            elif not r.splits and not r.release_split_ids:
                overrun.append(max(0.0, took - 1.0))
            held = [s for s in held if s not in set(r.release_split_ids)] + [s.split_id for s in r.splits]
            # A split "takes" about a second: the oldest is reported done by its consumer below.

    async def consumer(k: int) -> None:
        # Takes one split a second: the lowest its sync names an owner for.
        digest, delivered, next_seq = b"", [], 0
        while time.monotonic() < end:
            r = await stub.SyncConsumer(dpb.SyncConsumerRequest(
                job_id=job.job_id, consumer_index=k, epoch=0, owners_digest=digest, wait_s=1.0,
                next_seq=next_seq, delivered_seqs=delivered))
            digest, delivered = r.owners_digest, []
            if r.owners:
                lowest = min(r.owners, key=lambda o: o.first_seq)
                delivered = list(range(lowest.first_seq, lowest.first_seq + lowest.num_batches))
                next_seq = delivered[-1] + 1
            await asyncio.sleep(1.0)

    await asyncio.gather(*(worker(w) for w in ids), *(consumer(k) for k in range(consumers)))
    await ch.close()
    return asked, overrun, heartbeats


def p99_ms(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] * 1000 if len(values) > 1 else float("nan")


def load(fleet: list[int], consumers: int, samples: int, seconds: float) -> None:
    print(f"\n## dispatcher under load: fake workers heartbeating every 1 s, {consumers} consumers "
          f"syncing, a {samples:,}-sample job ({seconds:.0f} s each)")
    print(f"{'workers':>8} {'CPU % core':>11} {'hb/s':>7} {'p99 asking ms':>14} {'p99 idle overrun ms':>20} "
          f"{'RSS MB':>7}")
    for workers in fleet:
        with test_cluster(num_workers=0, heartbeat_interval_s=1.0, heartbeat_timeout_s=30,
                          consumer_timeout_s=30, split_size_batches=4) as c:
            pid = c.dispatcher.process.pid
            before, t0 = cpu_seconds(pid), time.monotonic()
            asked, overrun, heartbeats = asyncio.run(_load(c.address, workers, consumers, samples, seconds))
            busy = (cpu_seconds(pid) - before) / (time.monotonic() - t0)
            print(f"{workers:>8} {100 * busy:>11.1f} {heartbeats / seconds:>7.0f} {p99_ms(asked):>14.1f} "
                  f"{p99_ms(overrun):>20.1f} {rss_mb(pid):>7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, shorter runs")
    parser.add_argument("--huge", action="store_true", help="the first batch of a 10^9 shuffled epoch too")
    args = parser.parse_args()
    print(f"# control plane, {os.cpu_count()} cores, torch {torch.__version__}")
    plans([10**4, 10**6] if args.quick else [10**4, 10**6, 10**8, 10**9], args.huge)
    history([10, 100] if args.quick else [10, 100, 1000])
    load([10, 100] if args.quick else [10, 100, 1000], 256, 10**8, 5 if args.quick else 20)


if __name__ == "__main__":
    main()
