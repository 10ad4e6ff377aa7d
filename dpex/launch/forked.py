"""An embedded worker forked from its trainer, as torch's DataLoader forks
its workers: the trainer has imported torch already, so the worker's batch
processes (forked in turn, before the worker runs any thread) make their
first batch without a cold interpreter's second of imports.

Forking is safe only before gRPC runs threads in the trainer (its threads
would be missing in the child, holding its locks): :func:`dpex.daemon.can_fork` checks
that, and the embedded cluster spawns its worker otherwise.
"""
from __future__ import annotations

import gc
import os
import select
import signal
import sys
import threading
import time

from dpex import stdlib
from dpex.procutil import ChildProcess, output_to

class ForkedProcess(ChildProcess):
    """A child forked here, as a ``subprocess.Popen``."""

    def __init__(self, pid: int) -> None:
        super().__init__(pid)
        self._lock = threading.Lock()

    def _collect(self, timeout: float) -> None:
        with self._lock:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
                    return
        time.sleep(min(timeout, 0.01))


def fork_worker(processes: int, address_pipe: int, ready: str, log_path: str,
                auth_token: str | None, host: str = "127.0.0.1") -> ForkedProcess:
    """Forks the embedded worker of ``processes`` batch processes. It reads
    the dispatcher's address from ``address_pipe`` (the trainer writes it
    once the dispatcher serves; EOF: it did not start), writes ``ready``
    when it serves (as ``dpex-worker --ready-file``), logs to ``log_path``
    and stops when the trainer dies."""
    from dpex.procutil import flush_stdio
    flush_stdio()  # else their buffers would be written twice
    trainer = os.getpid()
    pid = os.fork()
    if pid:
        return ForkedProcess(pid)
    code = 1
    try:
        _serve(processes, address_pipe, ready, log_path, auth_token, host, trainer)
        code = 0
    except BaseException:  # noqa: BLE001 - reported in the log, which the trainer shows
        import traceback
        traceback.print_exc()
    finally:
        try:
            sys.stderr.flush()
        finally:
            os._exit(code)  # never the trainer's atexit handlers


def _serve(processes: int, address_pipe: int, ready: str, log_path: str, auth_token: str | None,
           host: str, trainer: int) -> None:
    # The trainer's objects are never collected here: none of its finalizers run
    # in this copy (it would close the trainer's things), and its pages stay shared.
    gc.freeze()
    os.setsid()  # as the embedded dispatcher: a Ctrl-C to the trainer's process group is the trainer's
    stdlib.forget_forkserver()  # the trainer's is not this process's child: its streams start their own
    for sig in signal.valid_signals():  # the trainer's handlers are not ours
        if callable(signal.getsignal(sig)) and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    output_to(log_path)
    # The trainer's may be anything (a test's capture, a progress bar's wrapper): ours are the log.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)

    from dpex.config import WorkerConfig
    from dpex.log import setup
    from dpex.procutil import reuse_freed_memory
    from dpex.worker import daemon
    from dpex.worker.pool import BatchPool

    setup("info")
    # First, while this process has one thread: the batch processes, forked with torch imported.
    # Its processes are the loader's num_workers: they take its batches in turn, as torch's workers.
    forked = daemon.fork_first(lambda: BatchPool(processes, fork=True, in_turn=True))
    pool = forked.pool
    try:
        reuse_freed_memory()  # as dpex-worker; after the fork: the batch processes keep glibc's defaults
        address = _read_address(address_pipe)
        if not address:  # the dispatcher did not start: the trainer reports why
            pool.close()
            return
        config = WorkerConfig(dispatcher=address, host=host, port=0, processes=processes, auth_token=auth_token,
                              in_turn=True, drain_timeout_s=0)  # nobody else uses it: nothing to drain
    except BaseException:
        pool.close()
        raise
    _watch(trainer)
    daemon.run(config, forked, ready)


def _read_address(fd: int) -> str:
    data = b""
    while chunk := os.read(fd, 256):
        data += chunk
        if data.endswith(b"\n"):
            break
    os.close(fd)
    return data.decode().strip()


def _watch(trainer: int) -> None:
    """SIGTERM to this process when the trainer dies. Not PR_SET_PDEATHSIG:
    that follows the trainer's thread that forked us, which may end first."""
    try:
        pidfd = os.pidfd_open(trainer)
    except (AttributeError, OSError):  # no pidfd (Linux < 5.3): the forking thread's death will do
        from dpex.procutil import die_with_parent
        die_with_parent(trainer)
        return

    def wait() -> None:
        select.select([pidfd], [], [])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait, name="dpex-trainer-watch", daemon=True).start()
    if os.getppid() != trainer:  # it died before the watch began
        os.kill(os.getpid(), signal.SIGTERM)
