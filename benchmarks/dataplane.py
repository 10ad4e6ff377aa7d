"""Data plane: large batches (64 x 3 x 224 x 224, uint8 and float32) with a
trivial transform, delivered to the trainer by Dpex, against a bare gRPC
stream of the same bytes and a bare TCP socket, measured in one run. Dpex
runs twice: over gRPC (``shared_memory=False``, what a trainer on another
host gets) and same-host (the trainer maps the worker's /dev/shm files).

    .venv/bin/python benchmarks/dataplane.py [--batches 40] [--processes 2]

The bare transports send pre-built bytes from a server process to this
process; Dpex also builds the batches (collate, encode) in its worker's
processes. Reported: GB/s into the trainer, the ratio to bare gRPC, the
trainer's CPU seconds per GB received, and the worker's (daemon, and its batch
processes); peak RSS of worker and trainer.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from concurrent import futures

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.measure import cpu_s, peak_rss_mb, reset_peak, tree  # noqa: E402

METHOD = "/bench.Bytes/Stream"


def _grpc_server(size: int, ready: mp.Queue, stop: mp.Event) -> None:
    import grpc
    from dpex.rpc import server_options
    payload = os.urandom(size)

    def stream(request: bytes, context):
        for _ in range(int(request.decode())):
            yield payload
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(4 << 20))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Bytes", {
        "Stream": grpc.unary_stream_rpc_method_handler(stream)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    ready.put(port)
    stop.wait()
    server.stop(0)


def _tcp_server(size: int, ready: mp.Queue, stop: mp.Event) -> None:
    payload = os.urandom(size)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ready.put(listener.getsockname()[1])
        conn, _ = listener.accept()
        with conn:
            count = int.from_bytes(conn.recv(8), "little")
            for _ in range(count):
                conn.sendall(payload)


def _serve(target, size: int):
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=target, args=(size, ready, stop), daemon=True)
    proc.start()
    return proc, stop, ready.get(timeout=60)


def bare_grpc(size: int, count: int) -> tuple[float, float]:
    import grpc
    from dpex.rpc import CHANNEL_OPTIONS
    proc, stop, port = _serve(_grpc_server, size)
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as ch:
        call = ch.unary_stream(METHOD, request_serializer=None, response_deserializer=None)
        list(call(b"2"))  # connect and warm up
        cpu0, start = cpu_s([os.getpid()]), time.perf_counter()
        got = sum(len(m) for m in call(str(count).encode()))
        wall, cpu = time.perf_counter() - start, cpu_s([os.getpid()]) - cpu0
    stop.set()
    proc.join()
    assert got == size * count
    return got / wall, cpu


def bare_tcp(size: int, count: int) -> tuple[float, float]:
    proc, stop, port = _serve(_tcp_server, size)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        cpu0, start = cpu_s([os.getpid()]), time.perf_counter()
        conn.sendall(count.to_bytes(8, "little"))
        got = 0
        for _ in range(count):
            buf = bytearray(size)  # a fresh buffer per message, as a receiver keeping batches needs
            view, filled = memoryview(buf), 0
            while filled < size:
                filled += conn.recv_into(view[filled:])
            got += filled
        wall, cpu = time.perf_counter() - start, cpu_s([os.getpid()]) - cpu0
    proc.join()
    return got / wall, cpu


def dpex_run(cluster, dtype: str, count: int, batch: int,
             shared_memory: bool) -> tuple[float, float, int, float, float, float, float]:
    spec = dpex.DatasetSpec("benchmarks.pipeline:LargeBatches", count * batch, dtype)
    me = [os.getpid()]
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=batch, timeout=300, shared_memory=shared_memory,
                               job_name=f"dataplane-{dtype}-{count}") as dl:
        for _ in dl:  # warm-up epoch
            pass
        workers = [pid for w in cluster.workers for pid in tree(w.process.pid)]
        daemons = [w.process.pid for w in cluster.workers]
        processes = [pid for pid in workers if pid not in daemons]
        reset_peak(workers + me)
        dl.stats(reset=True)
        cpu0, start = [cpu_s(p) for p in (me, daemons, processes)], time.perf_counter()
        for _ in dl:
            pass
        wall = time.perf_counter() - start
        cpu, daemon_cpu, process_cpu = (cpu_s(p) - c for p, c in zip((me, daemons, processes), cpu0))
        got = dl.stats().bytes_received
    return got / wall, cpu, got, peak_rss_mb(workers), peak_rss_mb(me), daemon_cpu, process_cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--processes", type=int, default=2)
    args = p.parse_args()
    B, n = args.batch_size, args.batches
    rows = []
    with dpex.LocalCluster(num_workers=1, processes=args.processes) as cluster:
        for dtype, itemsize in (("uint8", 1), ("float32", 4)):
            size = B * 3 * 224 * 224 * itemsize + 256  # + the frame's header
            g_rate, g_cpu = bare_grpc(size, n)
            t_rate, t_cpu = bare_tcp(size, n)
            for path, shm in (("gRPC", False), ("same-host", True)):
                rate, cpu, got, wrss, trss, dcpu, pcpu = dpex_run(cluster, dtype, n, B, shm)
                rows.append((f"{dtype}/{path}", size, rate, cpu / (got / 1e9), g_rate, g_cpu / (size * n / 1e9),
                             t_rate, t_cpu / (size * n / 1e9), wrss, trss, dcpu / (got / 1e9), pcpu / (got / 1e9)))
                print(f"{dtype}: dpex over {path} {rate / 1e9:.2f} GB/s, bare gRPC {g_rate / 1e9:.2f} GB/s, "
                      f"bare TCP {t_rate / 1e9:.2f} GB/s", flush=True)
    print(f"\n{n} batches of {B}x3x224x224 per run, worker with {args.processes} processes, "
          f"{os.cpu_count()} cores")
    print("dpex over gRPC: the loader with shared_memory=False (as from another host); same-host: the "
          "trainer maps the worker's /dev/shm files (the default on one machine)")
    print(f"{'dtype/path':17} {'MB/batch':>8} {'dpex GB/s':>9} {'gRPC GB/s':>9} {'TCP GB/s':>8} {'dpex/gRPC':>9} "
          f"{'dpex/TCP':>8} {'trainer CPU s/GB: dpex':>22} {'gRPC':>5} {'TCP':>5} {'RSS MB worker':>13} "
          f"{'trainer':>7} {'worker CPU s/GB: daemon':>23} {'processes':>9}")
    for dtype, size, rate, cpu_gb, g_rate, g_cpu_gb, t_rate, t_cpu_gb, wrss, trss, d_gb, p_gb in rows:
        print(f"{dtype:17} {size / 2**20:8.1f} {rate / 1e9:9.2f} {g_rate / 1e9:9.2f} {t_rate / 1e9:8.2f} "
              f"{rate / g_rate:9.3f} {rate / t_rate:8.3f} {cpu_gb:22.2f} {g_cpu_gb:5.2f} {t_cpu_gb:5.2f} "
              f"{wrss:13.0f} {trss:7.0f} {d_gb:23.2f} {p_gb:9.2f}")


if __name__ == "__main__":
    main()
