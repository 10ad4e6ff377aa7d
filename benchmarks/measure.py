"""What the benchmarks measure besides time: CPU seconds and peak RSS of
processes (and their children), read from /proc (Linux)."""
from __future__ import annotations

import os

from dpex.testing import descendants

_TICK = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    return [pid, *descendants(pid)]


def pin(pid: int, cores: set[int]) -> None:
    """Moves every thread of the process to ``cores`` (its threads started
    before keep their own affinity otherwise)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds the processes used so far (threads included)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total / _TICK


def _status(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_mb(pids: list[int]) -> float:
    """Sum of each process's peak resident set (VmHWM) since its last reset."""
    return sum(_status(pid, "VmHWM") for pid in pids) / 2**20


def reset_peak(pids: list[int]) -> None:
    """Starts a new peak RSS window (writing 5 to clear_refs resets VmHWM)."""
    for pid in pids:
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass
