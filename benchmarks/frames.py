"""Stream faults on the gRPC data plane: batches of 1-64 MiB streamed many
times, counting streams that fail on a healthy loopback.

    .venv/bin/python benchmarks/frames.py [--batches 1000]

Three runs: a bare gRPC bidirectional stream (the trainer asks, the server
answers, as Dpex's Fetch does) with grpc's default HTTP/2 flow control (BDP
probing, which re-announces the max frame size on the fly), the same stream
with Dpex's fixed flow-control options (dpex.rpc.FLOW_OPTIONS), and Dpex
itself over gRPC (``shared_memory=False``). Prints failures and GB/s.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import queue
import random
import sys
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402

SIZES = (1, 3, 5, 7, 12, 19, 27, 33, 48, 64)


def _server(options: list, ready: mp.Queue, stop: mp.Event) -> None:
    import grpc
    blobs = [os.urandom(s << 20) for s in SIZES]

    def fetch(requests, context):
        for r in requests:
            yield blobs[int(r.decode())]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Frames", {
        "Fetch": grpc.stream_stream_rpc_method_handler(fetch)}),))
    ready.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)


def bare(n: int, flow: list) -> tuple[int, float]:
    """(failed streams, GB/s) over ``n`` batches; the client pauses now and
    then, as a trainer does, so that the bandwidth estimate moves."""
    import grpc
    from dpex.rpc import CHANNEL_OPTIONS, FLOW_OPTIONS, server_options
    base = [o for o in CHANNEL_OPTIONS if o not in FLOW_OPTIONS]
    server_base = [o for o in server_options(4 << 20) if o not in FLOW_OPTIONS]
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_server, args=(server_base + flow, ready, stop), daemon=True)
    proc.start()
    port = ready.get(timeout=60)
    rnd = random.Random(0)
    failures = got = nbytes = 0
    start = time.perf_counter()
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=base + flow) as ch:
        while got < n:
            asks: queue.SimpleQueue = queue.SimpleQueue()
            call = ch.stream_stream("/bench.Frames/Fetch", request_serializer=None,
                                    response_deserializer=None)(iter(asks.get, None))
            try:
                for _ in range(4):
                    asks.put(str(rnd.randrange(len(SIZES))).encode())
                while got < n:
                    nbytes += len(next(call))
                    got += 1
                    asks.put(str(rnd.randrange(len(SIZES))).encode())
                    if rnd.random() < 0.05:
                        time.sleep(rnd.random() * 0.1)
                asks.put(None)
            except grpc.RpcError as e:
                failures += 1
                print(f"  stream failed after {got} batches: {e.code().name}: {e.details()}", flush=True)
            call.cancel()
    stop.set()
    proc.join()
    return failures, nbytes / 1e9 / (time.perf_counter() - start)


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.failures = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "failed" in record.getMessage():
            self.failures += 1
            print(" ", record.getMessage(), flush=True)


def through_dpex(n: int, processes: int) -> tuple[int, float]:
    counter = _Count()
    logging.getLogger("dpex.client").addHandler(counter)
    spec = dpex.DatasetSpec("dpex.testing.datasets:Sized", n, SIZES)
    nbytes = 0
    with dpex.LocalCluster(num_workers=1, processes=processes) as cluster, \
            dpex.RemoteDataLoader(cluster.address, spec, batch_size=1, shared_memory=False, timeout=300) as dl:
        start = time.perf_counter()
        for i, batch in enumerate(dl):
            assert batch.shape[1] == SIZES[i % len(SIZES)] << 20 and batch[0, -1] == i % 251
            nbytes += batch.numel()
    return counter.failures, nbytes / 1e9 / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--processes", type=int, default=2)
    args = p.parse_args()
    from dpex.rpc import FLOW_OPTIONS
    rows = []
    for name, run in (("bare gRPC, grpc's default flow control", lambda: bare(args.batches, [])),
                      ("bare gRPC, Dpex's fixed flow control", lambda: bare(args.batches, FLOW_OPTIONS)),
                      ("Dpex over gRPC (shared_memory=False)", lambda: through_dpex(args.batches, args.processes))):
        print(f"{name}: {args.batches} batches of {SIZES[0]}-{SIZES[-1]} MiB ...", flush=True)
        failures, gbs = run()
        rows.append((name, failures, gbs))
    print()
    for name, failures, gbs in rows:
        print(f"{name:42s} failed streams {failures:3d}   {gbs:5.2f} GB/s")


if __name__ == "__main__":
    main()
