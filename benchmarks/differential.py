"""The differential tester's long run (dpex.testing.differential): random
programs through torch's DataLoader and DpexDataLoader side by side, on a
test cluster of two workers; prints the programs and steps run, and the
first difference from torch with its shrunk program (exit 1) if one is found.

    .venv/bin/python benchmarks/differential.py [--programs 10000] [--steps 8] [--random]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dpex.testing import test_cluster  # noqa: E402
from dpex.testing.differential import Programs, run  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=8, help="steps per program, at most")
    p.add_argument("--random", action="store_true", help="programs drawn anew (default: hypothesis's derandomized)")
    args = p.parse_args()
    start, failed = time.monotonic(), None
    with test_cluster(num_workers=2, processes=1) as cluster:
        try:
            run(cluster.address, args.programs, args.steps, derandomize=not args.random)
        except Exception as e:  # noqa: BLE001 - the counterexample, printed
            failed = e
    elapsed = time.monotonic() - start
    print(f"programs {Programs.programs}, steps {Programs.steps}, {elapsed:.0f} s "
          f"({elapsed / max(1, Programs.programs):.2f} s a program): "
          f"{'a difference from torch: ' + str(failed) if failed else 'every output and generator state as torch'}")
    return 1 if failed else 0


if __name__ == "__main__":  # torch's workers start from a forkserver: this module is imported again
    sys.exit(main())
