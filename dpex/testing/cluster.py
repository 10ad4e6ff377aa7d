"""A test cluster with short heartbeats, and condition waits (never sleeps)."""
from __future__ import annotations

import os
import re
import socket
import time
from typing import Any, Callable

from dpex.launch.local import LocalCluster
from dpex.procutil import alive


def free_port() -> int:
    """A TCP port free on loopback now (nothing listens there: a refused address, or one to listen on)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEARTBEAT_TIMEOUT_S = 1.5  # the test clusters': a worker silent this long is lost


def test_cluster(num_workers: int = 2, processes: int = 1, **kwargs: Any) -> LocalCluster:
    """A LocalCluster that notices a lost worker within about a second."""
    # A heartbeat long-polls the dispatcher for its interval (answered at once when there is work): the
    # interval is what an idle cluster pays, not what a test waits. 0.5 s: an idle cluster takes 1.8 % of
    # a core (3.2 % at 0.2 s), the suite's dozens of them all the time; 3 beats in a timeout.
    kwargs.setdefault("heartbeat_interval_s", 0.5)
    kwargs.setdefault("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S)
    kwargs.setdefault("split_size_batches", 2)
    # Long enough that a live trainer on a loaded machine (the suite's two processes, the
    # differential tester's parallel runs) is never taken for gone; tests of a trainer's loss set 3 s.
    kwargs.setdefault("consumer_timeout_s", 10.0)
    # Every batch through a /dev/shm hand-off file, so that the same-host path
    # meets every failure the tests make.
    kwargs.setdefault("worker_flags", ("--shm-min-kb", "0"))
    # Forked from a process that imported torch once: the suite starts some two hundred workers, each
    # of which would import it again (a fifth of the suite's CPU). LocalCluster's own tests spawn.
    kwargs.setdefault("warm_start", True)
    return LocalCluster(num_workers=num_workers, processes=processes, **kwargs)


test_cluster.__test__ = False  # not a pytest test, despite the name


def kill_at(code: str, *args: str, line: str = "mid-epoch") -> None:
    """Runs ``python -c CODE ARGS`` (forked warm: dpex.testing.programs) until it prints ``line``, then
    kills it (SIGKILL): a trainer dying at a point of its own choosing."""
    import subprocess

    from dpex.testing import programs
    process = programs.popen(["-c", code, *args], stdout=subprocess.PIPE, text=True)
    try:
        got = process.stdout.readline()
        assert got == line + "\n", f"expected {line!r}, got {got!r}"
    finally:
        process.kill()
        process.wait()
        process.stdout.close()


def oracle_context() -> Any:
    """The start method for torch's DataLoader as a test's oracle, in a process
    that runs gRPC threads (fork could copy one mid-call): a forkserver that has
    imported torch, so that each of torch's workers is a fork of it rather than
    a new interpreter importing torch again, as spawn's are. Its workers unpickle
    the dataset as spawn's do; the test datasets' modules are imported once, in
    the forkserver, not in each worker (7x faster for the differential tester's
    programs; it takes effect only if the forkserver has not started yet)."""
    import multiprocessing
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "dpex.testing.datasets", "dpex.testing.differential"])
    return context


def wait_until(condition: Callable[[], Any], timeout_s: float = 30.0, what: str = "condition") -> Any:
    """Polls ``condition`` until it is truthy; raises TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)


def status_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """`dpex status` output as {"WORKERS": rows, "JOBS": rows}, a row being {column: cell}."""
    out: dict[str, list[dict[str, str]]] = {}
    title, header = None, None
    for line in text.splitlines():
        if line.startswith(("WORKERS", "JOBS")):
            title, header = line.split()[0], None
            out[title] = []
        elif line.startswith("WHERE THE TIME GOES"):  # lines of words, not a table
            title = None
        elif title and line.strip():
            cells = re.split(r"\s{2,}", line.strip())
            if header is None:
                header = cells
            else:
                out[title].append(dict(zip(header, cells)))
    return out


def descendants(pid: int) -> list[int]:
    """All live descendant processes of ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def pids_alive(pids: list[int]) -> list[int]:
    """The pids that still run (zombies count as gone)."""
    return [pid for pid in pids if alive(pid)]
