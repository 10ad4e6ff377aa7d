"""The differential tester's long run (dpex.testing.differential): random
programs through torch's DataLoader and DpexDataLoader side by side, on a
test cluster of two workers; prints the programs and steps run, and the
first difference from torch with its shrunk program (exit 1) if one is found.
A failure that hypothesis cannot replay (--random runs only: a timeout on a
machine the runs beside it load, say) is printed with the cluster's logs,
named in the tally, and the run goes on with new programs.

    .venv/bin/python benchmarks/differential.py [--programs 10000] [--steps 8] [--random] [--jobs 1]

``--jobs K`` runs K such runs at once (processes of their own, each with its
own cluster; the programs split among them, drawn anew in each) and sums
them: a program mostly waits on processes starting and ending, so a few
run side by side on two cores. Each run prints its count every minute.
"""
import argparse
import faulthandler
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing import test_cluster  # noqa: E402
from dpex.testing.differential import Programs, run  # noqa: E402
from hypothesis.errors import Flaky  # noqa: E402

TALLY = re.compile(r"^programs (\d+), steps (\d+), ")


def one(programs: int, steps: int, random: bool, stall_s: float = 600.0) -> int:
    start, failed, done = time.monotonic(), None, threading.Event()
    unreproduced: list[str] = []  # failures hypothesis could not replay: kept and named, not a difference

    def progress() -> None:
        last, since = -1, time.monotonic()
        while not done.wait(min(60.0, stall_s)):
            print(f"... {Programs.programs} programs, {Programs.steps} steps, {time.monotonic() - start:.0f} s",
                  flush=True)
            if Programs.steps != last:
                last, since = Programs.steps, time.monotonic()
            elif time.monotonic() - since > stall_s:  # a hang is a difference too: torch's steps end
                print(f"a difference from torch: no step ended for {stall_s:g}s (a hang); every thread's stack:",
                      flush=True)
                faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
                print(f"programs {Programs.programs}, steps {Programs.steps}, {time.monotonic() - start:.0f} s: "
                      "a difference from torch: a hang", flush=True)
                os._exit(3)
    threading.Thread(target=progress, daemon=True).start()
    # Timeouts for a loaded machine (--jobs runs side by side): no live daemon or trainer is taken for gone.
    with test_cluster(num_workers=2, processes=1, heartbeat_timeout_s=10.0, consumer_timeout_s=60.0) as cluster:
        while Programs.programs < programs and failed is None:
            try:
                run(cluster.address, programs - Programs.programs, steps, derandomize=not random)
            except Exception as e:  # noqa: BLE001 - the counterexample, printed
                kept = tempfile.mkdtemp(prefix=f"dpex-differential-{os.getpid()}-")
                for daemon in (cluster.dispatcher, *cluster.workers):  # what the daemons saw, kept
                    shutil.copy(daemon.log_path, kept)
                print(f"the cluster's logs: {kept}", flush=True)
                # The whole of it: a flaky replay holds the first failure among its sub-exceptions.
                print("".join(traceback.format_exception(e))[-20000:], flush=True)
                if isinstance(e, Flaky) and random:
                    # It did not happen again on replay (a timeout on a machine loaded by the runs beside it,
                    # say): named in the tally and looked at by hand, and the run goes on with new programs.
                    unreproduced.append(f"{type(e).__name__} ({kept})")
                    print(f"not reproduced on replay; going on ({len(unreproduced)} so far)", flush=True)
                    continue
                failed = e
    done.set()
    elapsed = time.monotonic() - start
    print(f"programs {Programs.programs}, steps {Programs.steps}, {elapsed:.0f} s "
          f"({elapsed / max(1, Programs.programs):.2f} s a program): "
          f"{'a difference from torch: ' + str(failed) if failed else 'every output and generator state as torch'}"
          f"{f'; {len(unreproduced)} failures not reproduced on replay: ' + ', '.join(unreproduced) if unreproduced else ''}",
          flush=True)
    return 1 if failed else 0


def many(jobs: int, programs: int, steps: int, stall_s: float) -> int:
    """``jobs`` runs of --random programs at once; their tallies summed."""
    start = time.monotonic()
    runs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--programs", str(-(-programs // jobs)),
                              "--steps", str(steps), "--random", "--stall-s", str(stall_s)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for _ in range(jobs)]
    tallies: list[tuple[int, int]] = []

    def follow(k: int, run_: subprocess.Popen) -> None:
        for line in run_.stdout:
            print(f"[{k}] {line}", end="", flush=True)
            m = TALLY.match(line)
            if m:
                tallies.append((int(m.group(1)), int(m.group(2))))
    threads = [threading.Thread(target=follow, args=(k, r)) for k, r in enumerate(runs)]
    for t in threads:
        t.start()
    codes = [r.wait() for r in runs]
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    total = sum(p for p, _ in tallies)
    print(f"all {jobs} runs: programs {total}, steps {sum(s for _, s in tallies)}, {elapsed:.0f} s "
          f"({elapsed / max(1, total):.2f} s a program); "
          f"{'every output and generator state as torch' if not any(codes) else 'a difference from torch (above)'}")
    return 1 if any(codes) else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=8, help="steps per program, at most")
    p.add_argument("--random", action="store_true", help="programs drawn anew (default: hypothesis's derandomized)")
    p.add_argument("--jobs", type=int, default=1, help="runs at once, each drawing anew (implies --random)")
    p.add_argument("--stall-s", type=float, default=600.0,
                   help="no step ended for this long: a hang, reported with every thread's stack (exit 3)")
    args = p.parse_args()
    if args.jobs > 1:
        return many(args.jobs, args.programs, args.steps, args.stall_s)
    return one(args.programs, args.steps, args.random, args.stall_s)


if __name__ == "__main__":  # torch's workers start from a forkserver: this module is imported again
    sys.exit(main())
