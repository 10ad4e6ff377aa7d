"""A daemon's life cycle, in one place. The daemon's side: serve until
SIGTERM or SIGINT, write the ready file, exit at once. The starter's side:
spawn ``python -m dpex.cmd.X --ready-file F``, await the ready file, stop
(SIGTERM, then SIGKILL), and say how a daemon ended in torch's words. And
whether this process may still fork one (no gRPC thread yet)."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from dpex.errors import DpexError
from dpex.procutil import flush_stdio


# ---- the daemon's side ---------------------------------------------------------------------
def serve_until_signalled(server: Any, ready_file: str | None) -> None:
    """Writes the ready file, waits for SIGTERM/SIGINT, then closes the server; on
    SIGHUP, ``server.reload()`` (the token file read again)."""
    # The signal's own wake-up byte, not a flag polled: the kernel may deliver the
    # signal to a gRPC thread, and Python runs handlers only in the main thread;
    # the C-level handler writes the byte to this pipe from any thread. (A flag
    # set by the handler would do too, but only when the main thread next runs.)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # A no-op handler: an Event.set() here could run inside another handler
        # (a burst of SIGTERMs) and wait for a lock the outer one holds, forever.
        signal.signal(sig, lambda signum, _: None)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        metrics = getattr(server, "metrics", None)
        with open(tmp, "w") as f:  # the address, then the metrics port and scheme (if any)
            f.write(server.address + (f"\n{metrics.port} {metrics.scheme}" if metrics is not None else ""))
        os.replace(tmp, ready_file)
    stops = {signal.SIGTERM, signal.SIGINT}
    while not stops & (got := set(os.read(wake_r, 64))):  # a byte per signal: its number
        if signal.SIGHUP in got:
            server.reload()
    signal.set_wakeup_fd(old_wakeup)
    os.close(wake_r)
    os.close(wake_w)
    logging.getLogger("dpex").info("shutting down")
    server.close()


def exit_now(code: int = 0) -> None:
    """Ends a daemon whose server is closed: the exit handlers run (logs,
    multiprocessing's children and files), then the process ends without
    Python tearing down its modules one by one (torch's take half a second
    of CPU, and a daemon has nothing left to keep)."""
    import atexit
    atexit._run_exitfuncs()
    logging.shutdown()
    flush_stdio()
    os._exit(code)


# Threads that gRPC's core starts at its first channel or server (their
# names, cut to 15 characters by the kernel).
_GRPC_THREADS = ("grpc", "event_engine", "lifeguard", "default-executo", "resolver-execut")


def can_fork() -> bool:
    """This process may fork a worker: Linux's fork, and no gRPC thread yet."""
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                name = f.read().strip()
        except OSError:  # a thread that just ended
            continue
        if name.startswith(_GRPC_THREADS):
            return False
    return True


# ---- the starter's side --------------------------------------------------------------------
@dataclass
class Daemon:
    """One daemon process started by a LocalCluster."""
    name: str
    process: subprocess.Popen
    address: str
    log_path: str
    metrics_port: int | None = None  # with LocalCluster(metrics=True)
    metrics_scheme: str = "http"     # https where the daemon serves TLS

    @property
    def metrics_url(self) -> str | None:
        if self.metrics_port is None:
            return None
        return f"{self.metrics_scheme}://{self.address.rsplit(':', 1)[0]}:{self.metrics_port}/metrics"

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""


def stop_process(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM (a daemon drains), then SIGKILL after ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def spawn(args: list[str], ready: str, log_path: str, env: dict[str, str], **popen: Any) -> subprocess.Popen:
    """Starts ``python -m ARGS --ready-file READY``, its output appended to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", *args, "--ready-file", ready], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env, **popen)


def await_ready(name: str, process: subprocess.Popen, ready: str, log_path: str,
                timeout_s: float) -> Daemon:
    """Waits for a daemon started with ``--ready-file ready`` to serve; a
    DpexError with its log's tail if it exits or does not serve in time."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(ready):
        daemon = Daemon(name, process, "", log_path)
        if process.poll() is not None:
            raise DpexError(f"{name} exited with code {process.returncode} at start:\n{daemon.log_tail()}")
        if time.monotonic() > deadline:
            stop_process(process)
            raise DpexError(f"{name} did not start within {timeout_s:g}s:\n{daemon.log_tail()}")
        time.sleep(0.05)
    with open(ready) as f:
        address, *metrics = f.read().split()
    return Daemon(name, process, address, log_path, int(metrics[0]) if metrics else None, *metrics[1:2])


def exit_reason(pid: int, code: int) -> str:
    """A daemon's end in torch's words for its workers' ("DataLoader worker
    (pid N) is killed by signal: Killed.")."""
    if code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        return f"(pid {pid}) is killed by signal: {name}."
    return f"(pid {pid}) exited unexpectedly with exit code {code}."
