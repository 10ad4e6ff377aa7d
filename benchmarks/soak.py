"""A soak: a small job for many epochs on a local cluster with a journal, a
worker restarted every few epochs (SIGKILL and SIGTERM in turn) and a
validation loader opened and closed every so often, while the resources of
every process and of the machine that Dpex uses are sampled: the resident
memory, open file descriptors and threads of the dispatcher, of each worker
(with its batch processes) and of the trainer, Dpex's files in /dev/shm and
its directories in the temp directory, and the journal's size (counted are
the entries whose name holds the pid of one of the soak's processes, live or
killed: another run beside it is not counted).

    .venv/bin/python benchmarks/soak.py [--epochs 1000] [--minutes 0] [--churn 20] [--compact-kb 4] [--gc-s 10]

Prints, per figure, its value after warm-up (the first tenth) and at the end,
its least-squares slope per 100 epochs, and "flat" or "GROWS" (grown by more
than 10 % and by more than its noise); writes the curves as an SVG. Exits
non-zero if a figure grows or an epoch is not exact.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import dpex  # noqa: E402
from dpex import procutil  # noqa: E402
from dpex.testing import descendants, test_cluster  # noqa: E402

N, B = 64, 8
# Absolute noise below which growth is not growth: a few MB of allocator slack, a descriptor or thread that
# comes and goes with a connection, a file being handed over.
NOISE = {"MB": 8.0, "fds": 4, "threads": 4, "files": 4, "dirs": 2, "KB": 64.0}


def proc_figures(pid: int) -> tuple[float, int, int]:
    """Resident MB, open descriptors and threads of ``pid`` (0s if it is gone)."""
    try:
        status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
        return (int(status["VmRSS"].split()[0]) / 1024, len(os.listdir(f"/proc/{pid}/fd")),
                int(status["Threads"]))
    except (OSError, KeyError, ValueError):
        return 0.0, 0, 0


def tree_figures(pid: int) -> tuple[float, int, int]:
    """The same, summed over ``pid`` and its descendants (a worker and its batch processes)."""
    figures = [proc_figures(p) for p in [pid, *descendants(pid)]]
    return sum(f[0] for f in figures), sum(f[1] for f in figures), sum(f[2] for f in figures)


def dir_size_kb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files) / 1024


def owned(root: str, pids: set[int], files: bool) -> int:
    """Dpex's entries in ``root`` that one of ``pids`` owns (its pid in the name),
    with the files in them if ``files``: what the soak's processes, live or killed, left."""
    count = 0
    for entry in os.listdir(root):
        if procutil.owner_pid(entry) in pids:
            path = os.path.join(root, entry)
            count += 1 + (sum(len(f) for _, _, f in os.walk(path)) if files and os.path.isdir(path) else 0)
    return count


def sample(cluster, work_dir: str, pids: set[int]) -> dict[str, float]:
    """Every figure now; ``pids``: every process of the soak's so far (grown here)."""
    pids |= {os.getpid(), cluster.dispatcher.process.pid}
    for w in cluster.workers:
        pids |= {w.process.pid, *descendants(w.process.pid)}
    out: dict[str, float] = {}
    for name, pid, figures in [("dispatcher", cluster.dispatcher.process.pid, proc_figures),
                               ("trainer", os.getpid(), proc_figures),
                               *[(f"worker {k}", w.process.pid, tree_figures) for k, w in enumerate(cluster.workers)]]:
        mb, fds, threads = figures(pid)
        out[f"{name} MB"], out[f"{name} fds"], out[f"{name} threads"] = mb, fds, threads
    out["/dev/shm dpex files"] = owned("/dev/shm", pids, files=True)  # hand-off directories and their files
    out["temp dpex dirs"] = owned(tempfile.gettempdir(), pids, files=False)  # (the cluster's keeps every log)
    out["journal KB"] = dir_size_kb(work_dir)
    return out


def unit(name: str) -> str:
    return next((u for u in NOISE if name.endswith(u)), "files")


def verdicts(epochs: list[int], series: dict[str, list[float]]) -> list[tuple[str, float, float, float, bool]]:
    """(figure, after warm-up, at the end, slope per 100 epochs, grows) per figure."""
    rows = []
    warm = max(1, len(epochs) // 10)
    xs = epochs[warm:]
    for name, ys in series.items():
        ys = ys[warm:]
        if len(xs) < 3:
            continue
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        start, end = ys[0], ys[-1]
        fitted_growth = slope * (xs[-1] - xs[0])
        grows = fitted_growth > max(0.10 * max(abs(my), 1e-9), NOISE[unit(name)])
        rows.append((name, start, end, slope * 100, grows))
    return rows


def svg(epochs: list[int], series: dict[str, list[float]], path: str) -> None:
    """The curves, one small chart per figure, as an SVG (no plotting library needed)."""
    names = list(series)
    cols, w, h, pad = 4, 300, 140, 30
    rows = (len(names) + cols - 1) // cols
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * w}" height="{rows * h}" '
             'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    x0, x1 = min(epochs), max(epochs) or 1
    for k, name in enumerate(names):
        ox, oy = (k % cols) * w, (k // cols) * h
        ys = series[name]
        lo, hi = min(0.0, min(ys)), max(ys) * 1.1 or 1.0
        pts = " ".join(f"{ox + pad + (x - x0) / max(1, x1 - x0) * (w - 2 * pad):.1f},"
                       f"{oy + h - pad + (lo - y) / (hi - lo) * (h - 2 * pad):.1f}" for x, y in zip(epochs, ys))
        parts += [f'<text x="{ox + pad}" y="{oy + 16}">{name} (0 to {hi:.0f})</text>',
                  f'<rect x="{ox + pad}" y="{oy + pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" '
                  'fill="none" stroke="#ccc"/>',
                  f'<polyline points="{pts}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>',
                  f'<text x="{ox + pad}" y="{oy + h - 8}" fill="#666">epoch {x0} to {x1}</text>']
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=1000)
    p.add_argument("--minutes", type=float, default=0.0, help="run at least this long (and --epochs)")
    p.add_argument("--churn", type=int, default=20, help="restart a worker every this many epochs")
    p.add_argument("--validate", type=int, default=50, help="open and close a validation loader every ...")
    p.add_argument("--every", type=int, default=10, help="sample every this many epochs")
    p.add_argument("--compact-kb", type=int, default=4,
                   help="the dispatcher's --journal-compact-kb: small, so that the soak compacts the journal many "
                        "times (at the default 256 KB a short soak only appends)")
    p.add_argument("--gc-s", type=float, default=10.0,
                   help="the dispatcher's --job-gc-timeout and --worker-gc-timeout: short, so that the validation "
                        "loaders' jobs are collected within the soak (the default keeps a finished job 300 s)")
    p.add_argument("--svg", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "soak.svg"))
    args = p.parse_args()
    work_dir = tempfile.mkdtemp(prefix="soak-journal-")
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=N)
    epochs: list[int] = []
    series: dict[str, list[float]] = {}
    inexact, restarts, pids = 0, 0, set()
    start = time.monotonic()
    try:
        with test_cluster(num_workers=2, work_dir=work_dir, consumer_timeout_s=30.0,
                          dispatcher_flags=("--journal-compact-kb", str(args.compact_kb), "--job-gc-timeout",
                                            str(args.gc_s), "--worker-gc-timeout", str(args.gc_s))) as cluster, \
                dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, shuffle=True, seed=0, timeout=120) as dl:
            epoch = 0
            while epoch < args.epochs or time.monotonic() - start < args.minutes * 60:
                got = sorted(y for b in dl for y in b["y"].tolist())
                inexact += got != list(range(N))
                epoch += 1
                if epoch % args.churn == 0:  # SIGKILL and SIGTERM in turn, the worker back on its address
                    sample(cluster, work_dir, pids)  # the pids of the one about to go, to count what it leaves
                    k = restarts % len(cluster.workers)
                    cluster.restart_worker(k, signal.SIGKILL if restarts % 2 == 0 else signal.SIGTERM)
                    restarts += 1
                if epoch % args.validate == 0:
                    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=B, timeout=120) as val:
                        inexact += sorted(y for b in val for y in b["y"].tolist()) != list(range(N))
                if epoch % args.every == 0:
                    epochs.append(epoch)
                    for name, value in sample(cluster, work_dir, pids).items():
                        series.setdefault(name, []).append(value)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
    minutes = (time.monotonic() - start) / 60
    print(f"{epochs[-1] if epochs else 0} epochs of {N} samples in {minutes:.1f} min, {restarts} worker restarts, "
          f"{inexact} epochs not exact")
    print("| figure | after warm-up | at the end | slope per 100 epochs | verdict |")
    print("|---|---|---|---|---|")
    rows = verdicts(epochs, series)
    for name, first, last, slope, grows in rows:
        print(f"| {name} | {first:.1f} | {last:.1f} | {slope:+.2f} | {'GROWS' if grows else 'flat'} |")
    svg(epochs, series, args.svg)
    print(f"curves: {args.svg}")
    return 0 if not inexact and not any(r[4] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
