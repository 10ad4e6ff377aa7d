"""Compression per job, measured: uint8 batches of real decoded images
(64 x 3 x 224 x 224) with compression=None / "lz4" / "zstd", delivered over
gRPC (shared_memory=False, as to a trainer on another host).

    .venv/bin/python benchmarks/compression.py [--batches 40]

Prints each codec's ratio and speed on one batch in this process, the
end-to-end rate on loopback with worker and trainer CPU per GB, and the link
speed below which the codec pays: with P worker processes compressing at C
and the trainer decompressing at D, a link of L bytes/s delivers L raw
bytes/s plain and min(L x ratio, P x C, D) compressed — so it pays while
L < min(P x C, D).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from benchmarks.measure import cpu_s, tree  # noqa: E402
from benchmarks.pipeline import DecodedImages, make_images  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from dpex.wire import encode_parts  # noqa: E402
from dpex.wire.compression import compress, decompress  # noqa: E402


def codec_speed(codec: str, raw: bytes) -> tuple[float, float, float]:
    """ratio, compress bytes/s, decompress bytes/s (raw bytes per second)."""
    start = time.perf_counter()
    for _ in range(3):
        packed = compress(codec, [raw])
    c = 3 * len(raw) / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(3):
        decompress(codec, packed, len(raw))
    return len(raw) / len(packed), c, 3 * len(raw) / (time.perf_counter() - start)


def run(cluster, worker: list[int], root: str, codec: str | None, n: int, B: int) -> tuple[float, float, float]:
    """Raw GB/s on loopback, worker and trainer CPU seconds per raw GB."""
    spec = dpex.DatasetSpec("benchmarks.pipeline:DecodedImages", root, n * B)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, timeout=300, shared_memory=False,
                               compression=codec, job_name=f"compression-{root}-{codec}") as dl:
        for _ in dl:  # warm-up epoch
            pass
        me, w0, start = cpu_s([os.getpid()]), cpu_s(worker), time.perf_counter()
        for _ in dl:
            pass
        wall = time.perf_counter() - start
        trainer, work = cpu_s([os.getpid()]) - me, cpu_s(worker) - w0
    gb = n * B * 3 * 224 * 224 / 1e9
    return gb / wall, work / gb, trainer / gb


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--data", default=".data/bench-images")
    args = p.parse_args()
    sets = {"noisy": make_images(os.path.abspath(args.data), 1536, 256),  # pixel noise sd 8, like photos
            "smooth": make_images(os.path.abspath(args.data) + "-smooth", 64, 256, noise=0.0)}  # renders
    B, n = 64, args.batches
    rows = []
    with dpex.LocalCluster(num_workers=1, processes=args.processes) as cluster:
        worker = tree(cluster.workers[0].process.pid)
        for images, root in sets.items():
            sample = DecodedImages(root, B)
            raw = b"".join(bytes(memoryview(x).cast("B"))
                           for x in encode_parts(default_collate([sample[i] for i in range(B)])))
            for codec in (None, "lz4", "zstd"):
                ratio, c, d = codec_speed(codec, raw) if codec else (1.0, 0.0, 0.0)
                rate, work, trainer = run(cluster, worker, root, codec, n, B)
                rows.append((images, codec or "none", ratio, c, d, rate, work, trainer))
                print(f"{images} images, {codec or 'none'}: {rate:.2f} GB/s raw on loopback", flush=True)
    print(f"\n{n} batches of 64x3x224x224 uint8 decoded images (9.2 MB), over gRPC on loopback, "
          f"worker with {args.processes} processes, {os.cpu_count()} cores")
    print(f"{'images':7} {'codec':6} {'ratio':>6} {'compress GB/s':>13} {'decompress GB/s':>15} "
          f"{'loopback GB/s':>13} {'worker CPU s/GB':>15} {'trainer CPU s/GB':>16}  pays on links slower than")
    for images, codec, ratio, c, d, rate, work, trainer in rows:
        if codec == "none":
            pays = cs = ds = "-"
        else:
            cs, ds = f"{c / 1e9:.2f}", f"{d / 1e9:.2f}"
            limit = min(args.processes * c, d)  # raw bytes/s the codec can sustain
            pays = "never (ratio < 1.05)" if ratio < 1.05 else f"{8 * limit / 1e9:.1f} Gbit/s"
        print(f"{images:7} {codec:6} {ratio:6.2f} {cs:>13} {ds:>15} {rate:13.2f} {work:15.2f} {trainer:16.2f}  {pays}")


if __name__ == "__main__":
    main()
