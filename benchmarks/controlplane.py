"""The control plane at scale: plans, journal and dispatcher load.

    .venv/bin/python benchmarks/controlplane.py [--quick] [--huge]

- plan submission for a shuffled epoch of 10^4 .. 10^9 samples (batch 1024),
  with torch's RandomSampler (`shuffle=True`) and with dpex.ShuffleSampler:
  bytes of the SubmitPlan request, seconds for `iter()` (describe + submit)
  and to the first batch, beside a torch DataLoader's first batch with the
  same sampler (RandomSampler up to 10^8: it needs 36 GB of Python ints for
  10^9). With RandomSampler the worker's first batch draws torch's
  permutation of the whole dataset once per epoch (O(n), as torch does;
  --huge runs 10^9 too); ShuffleSampler computes only the batch's positions;
- the work dir after 10, 100 and 1,000 short epochs (journal + snapshot);
- a dispatcher's restart (kill -9, same --work-dir) after that history:
  seconds until it serves again;
- a real dispatcher process driven over gRPC by fake workers (10, 100,
  1,000; a connection each) heartbeating at the default long poll and 256
  fake consumers syncing with plans in work (each taking a split a second):
  the dispatcher's CPU (fraction of one core, including the setup:
  registering the workers, submitting the plans), calls per second, the
  p50/p99 of heartbeats asking for a split (there are always some to take,
  so they come back at once) from a probe process of their own (beside it,
  a health check's p99: the transport alone) once the fleet is set up and
  every worker has made its first poll (and their p99 before: the fleet
  connecting and registering at once), how long idle heartbeats poll, and
  its RSS. With 2+ cores the dispatcher gets one core to itself. The
  1,000-worker fleet again with a --work-dir ("durable"): every assignment
  and delivery journaled, answers held until they are on disk;
- real workers (1 and 4 daemons of 2 processes) feeding one trainer an epoch
  of 200 splits: worker heartbeats the dispatcher answered per split
  (`dpex_worker_heartbeats_total`), what a fleet's heartbeat rate follows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpc  # noqa: E402
import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

import dpex  # noqa: E402
from dpex.client.sampling import Indices  # noqa: E402
from dpex.config import DispatcherConfig  # noqa: E402
from dpex.plan import samplers  # noqa: E402
from dpex.version import versions  # noqa: E402
from dpex.proto import dispatcher_pb2 as dpb  # noqa: E402
from dpex.proto import dispatcher_pb2_grpc as dgrpc  # noqa: E402
from dpex.testing import test_cluster  # noqa: E402


def _sampler(kind: str, n: int) -> dpex.ShuffleSampler | None:
    return dpex.ShuffleSampler(n, seed=0) if kind == "ShuffleSampler" else None  # None: shuffle=True


def plans(sizes: list[int], huge_first_batch: bool) -> None:
    print("\n## plan submission, shuffled, batch 1024 (after a warm-up epoch: the worker has imported torch)")
    print(f"{'sampler':>15} {'samples':>14} {'request B':>10} {'iter() s':>9} {'1st batch s':>12} {'torch 1st s':>12}")
    with test_cluster(num_workers=1, heartbeat_interval_s=1.0, heartbeat_timeout_s=60) as c:
        warm = dpex.DatasetSpec("dpex.client.sampling:Indices", 10**4)
        with dpex.RemoteDataLoader(c.address, warm, batch_size=1024, shuffle=True, timeout=600) as dl:
            next(iter(dl))
        for kind in ("RandomSampler", "ShuffleSampler"):
            for n in sizes:
                random_sampler = kind == "RandomSampler"
                spec = dpex.DatasetSpec("dpex.client.sampling:Indices", n)
                with dpex.RemoteDataLoader(c.address, spec, batch_size=1024, shuffle=random_sampler,
                                           sampler=_sampler(kind, n), timeout=600) as dl:
                    torch.manual_seed(0)
                    probe = tud.DataLoader(Indices(n), batch_size=1024, shuffle=random_sampler,
                                           sampler=_sampler(kind, n))
                    iter(probe)
                    request = dpb.SubmitPlanRequest(job_id=1, epoch=0, base_seed=2**62,
                                                    sampler=samplers.describe(probe))
                    started = time.perf_counter()
                    it = iter(dl)
                    submitted = time.perf_counter() - started
                    first = "skipped"
                    if n < 10**9 or huge_first_batch or not random_sampler:
                        next(it)
                        first = f"{time.perf_counter() - started:.3f}"
                    it.close()
                torch_first = "n/a"
                if n <= 10**8 or not random_sampler:  # RandomSampler: 36 GB of Python ints for 10^9
                    started = time.perf_counter()
                    next(iter(tud.DataLoader(Indices(n), batch_size=1024, shuffle=random_sampler,
                                             sampler=_sampler(kind, n))))
                    torch_first = f"{time.perf_counter() - started:.3f}"
                print(f"{kind:>15} {n:>14,} {request.ByteSize():>10} {submitted:>9.3f} {first:>12} "
                      f"{torch_first:>12}")


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def history(counts: list[int]) -> None:
    print("\n## work dir and restart after N short epochs (8 batches each, 2 workers)")
    print(f"{'epochs':>7} {'work dir KB':>12} {'restart s':>10}")
    spec = dpex.DatasetSpec("dpex.client.sampling:Indices", 32)
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


async def _load(address: str, workers: int, consumers: int, samples: int, seconds: float,
                interval: float) -> tuple[list, int, float]:
    ch = grpc.aio.insecure_channel(address)
    stub = dgrpc.DispatcherStub(ch)
    job = await stub.GetOrCreateJob(dpb.GetOrCreateJobRequest(job=dpb.JobDef(
        name="load", dataset=b"x", num_consumers=consumers, batch_size=1024)))
    for k in range(consumers):
        sampler = dpb.SamplerSpec(torch_version=samplers.torch_version(), length=samples, batch_size=1024,
                                  kind=dpb.SamplerSpec.DISTRIBUTED, seed=0, num_replicas=consumers, rank=k,
                                  shuffle=True)
        await stub.SubmitPlan(dpb.SubmitPlanRequest(job_id=job.job_id, job_key=job.job_key, consumer_index=k,
                                                    epoch=0, sampler=sampler))
    registered = [await stub.RegisterWorker(dpb.RegisterWorkerRequest(address=f"10.0.{i // 250}.{i % 250}:1",
                                                                      versions=versions()))
                  for i in range(workers)]
    keys = {r.worker_id: r.worker_key for r in registered}
    ids = list(keys)
    steady = time.monotonic() + interval  # set up; every worker's first poll (spread over an interval) done
    end = time.monotonic() + seconds
    idle: list[float] = []  # heartbeats that came back with nothing: how long they polled
    make_s = max(1.0, workers / consumers)  # seconds a fake worker takes to produce a split
    heartbeats = 0

    async def worker(worker_id: str) -> None:
        nonlocal heartbeats
        # A connection of its own, as a worker has (HTTP/2 caps the streams of one).
        own = grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        stub = dgrpc.DispatcherStub(own)
        # As dpex.worker.agent: room for a split being produced; a split takes
        # workers / consumers seconds to produce (the fleet makes what the
        # consumers below take, a split a second each), and the poll is cut
        # short when it is done (room beyond what it asked for); a split is
        # dropped when an answer says so (its consumer acknowledged it, or left).
        held: dict[int, float] = {}  # split id -> when it is produced
        while time.monotonic() < end:
            started = time.monotonic()
            producing = [t for t in held.values() if t > started]
            call = stub.WorkerHeartbeat(dpb.WorkerHeartbeatRequest(
                worker_id=worker_id, worker_key=keys[worker_id], want_splits=max(0, 1 - len(producing)),
                held_split_ids=list(held)))
            try:
                r = await (asyncio.wait_for(call, min(producing) - started) if producing else call)
            except asyncio.TimeoutError:  # a split was produced: ask again (the call is cancelled)
                continue
            heartbeats += 1
            if not r.splits and not r.release_split_ids:
                idle.append(time.monotonic() - started)
            for split_id in r.release_split_ids:
                held.pop(split_id, None)
            for split in r.splits:
                held[split.split_id] = time.monotonic() + make_s * random.uniform(0.8, 1.2)
        await own.close()

    async def consumer(k: int) -> None:
        # Takes one split a second: the lowest its sync names an owner for.
        digest, delivered, next_seq = b"", [], 0
        await asyncio.sleep(random.random())  # trainers are not in lockstep to the millisecond
        while time.monotonic() < end:
            r = await stub.SyncConsumer(dpb.SyncConsumerRequest(
                job_id=job.job_id, job_key=job.job_key, consumer_index=k, epoch=0, owners_digest=digest, wait_s=1.0,
                next_seq=next_seq, delivered_seqs=delivered))
            digest, delivered = r.owners_digest, []
            if r.owners:
                lowest = min(r.owners, key=lambda o: o.first_seq)
                delivered = list(range(lowest.first_seq, lowest.first_seq + lowest.num_batches))
                next_seq = delivered[-1] + 1
            await asyncio.sleep(1.0)

    await asyncio.gather(*(worker(w) for w in ids), *(consumer(k) for k in range(consumers)))
    await ch.close()
    return idle, heartbeats, steady


def probe(address: str, seconds: float) -> None:
    """A worker of its own process asking for a split every 20 ms (there are
    always some to take, so each heartbeat should come back at once), and a
    health check beside it; prints (when, heartbeat s, health s) of each."""
    ch = grpc.insecure_channel(address)
    stub = dgrpc.DispatcherStub(ch)
    health = health_pb2_grpc.HealthStub(ch)
    registered = stub.RegisterWorker(dpb.RegisterWorkerRequest(address="10.255.0.1:1", versions=versions()))
    worker_id = registered.worker_id
    samples, held = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest())
        check = time.perf_counter() - started
        started = time.perf_counter()
        r = stub.WorkerHeartbeat(dpb.WorkerHeartbeatRequest(worker_id=worker_id, worker_key=registered.worker_key,
                                                            want_splits=1,
                                                            held_split_ids=held))
        samples.append((time.monotonic(), time.perf_counter() - started, check))
        held = [s for s in held if s not in set(r.release_split_ids)] + [s.split_id for s in r.splits]
        time.sleep(0.02)
    print(json.dumps(samples))


def p99_ms(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] * 1000 if len(values) > 1 else float("nan")


def load(fleet: list[int], consumers: int, samples: int, seconds: float, durable: list[int] = ()) -> None:
    interval = DispatcherConfig.heartbeat_interval_s
    cores = sorted(os.sched_getaffinity(0))
    print(f"\n## dispatcher under load: fake workers heartbeating (default {interval:g} s long poll, a "
          f"connection each), {consumers} consumers syncing, a {samples:,}-sample job ({seconds:.0f} s each)")
    if len(cores) > 1:
        print(f"(the dispatcher on core {cores[0]}, the load generator and the probe on the other cores)")
    print("(heartbeat and health latencies once the fleet is set up and every worker's first poll is done; "
          "'setup p99': the heartbeats before, while 1,000 workers connect and register at once)")
    print(f"{'workers':>16} {'CPU % core':>11} {'hb/s':>8} {'hb p50 ms':>10} {'hb p99 ms':>10} "
          f"{'health p99':>11} {'setup p99':>10} {'idle poll s':>12} {'RSS MB':>7}")
    for workers, journaled in [(w, False) for w in fleet] + [(w, True) for w in durable]:
        with tempfile.TemporaryDirectory() as work_dir, test_cluster(
                num_workers=0, heartbeat_interval_s=interval, heartbeat_timeout_s=30, consumer_timeout_s=30,
                split_size_batches=4, work_dir=work_dir if journaled else None) as c:
            pid = c.dispatcher.process.pid
            if len(cores) > 1:
                os.sched_setaffinity(pid, cores[:1])
                os.sched_setaffinity(0, cores[1:])
            before, t0 = cpu_seconds(pid), time.monotonic()
            prober = subprocess.Popen([sys.executable, __file__, "--probe", c.address, str(seconds - 2)],
                                      stdout=subprocess.PIPE, text=True)
            try:
                idle, heartbeats, steady = asyncio.run(_load(c.address, workers, consumers, samples, seconds,
                                                             interval))
                busy = (cpu_seconds(pid) - before) / (time.monotonic() - t0)
                probed = json.loads(prober.communicate(timeout=60)[0])
            finally:
                prober.kill()
                os.sched_setaffinity(0, cores)
            beats = [b for when, b, _ in probed if when >= steady]
            checks = [h for when, _, h in probed if when >= steady]
            setup = [b for when, b, _ in probed if when < steady]
            print(f"{workers:>8}{' durable' if journaled else '':>8} {100 * busy:>11.1f} {heartbeats / seconds:>8.0f} "
                  f"{statistics.median(beats) * 1000:>10.1f} {p99_ms(beats):>10.1f} {p99_ms(checks):>11.1f} "
                  f"{p99_ms(setup):>10.1f} {statistics.median(idle) if idle else float('nan'):>12.2f} "
                  f"{rss_mb(pid):>7.1f}")


def calls(worker_counts: list[int], splits: int = 200) -> None:
    """Heartbeats answered per split with real workers and a real trainer."""
    from benchmarks.pipeline import IOBound
    print(f"\n{'workers':>7} {'splits':>7} {'heartbeats':>11} {'per split':>10} {'epoch s':>8}")
    for workers in worker_counts:
        with dpex.LocalCluster(num_workers=workers, processes=2) as c, \
                grpc.insecure_channel(c.address) as ch:
            stub = dgrpc.DispatcherStub(ch)
            dataset = IOBound(16 * 4 * splits, wait_s=0.002, size=8)  # splits of 4 batches of 16
            with dpex.RemoteDataLoader(c.address, dataset, batch_size=16) as dl:
                for _ in dl:  # warm-up epoch: the processes build the dataset
                    pass
                before = stub.GetStatus(dpb.GetStatusRequest())
                start = time.perf_counter()
                for _ in dl:
                    pass
                wall = time.perf_counter() - start
                after = stub.GetStatus(dpb.GetStatusRequest())
        beats = after.worker_heartbeats_total - before.worker_heartbeats_total
        done = after.splits_assigned_total - before.splits_assigned_total
        print(f"{workers:>7} {done:>7} {beats:>11} {beats / done:>10.2f} {wall:>8.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, shorter runs")
    parser.add_argument("--huge", action="store_true", help="the first batch of a 10^9 shuffled epoch too")
    parser.add_argument("--probe", nargs=2, metavar=("ADDRESS", "SECONDS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe[0], float(args.probe[1]))
        return
    print(f"# control plane, {os.cpu_count()} cores, torch {torch.__version__}")
    plans([10**4, 10**6] if args.quick else [10**4, 10**6, 10**8, 10**9], args.huge)
    history([10, 100] if args.quick else [10, 100, 1000])
    load([10, 100] if args.quick else [10, 100, 1000], 256, 10**8, 10 if args.quick else 30,
         [100] if args.quick else [1000])
    calls([1, 4])


if __name__ == "__main__":
    main()
