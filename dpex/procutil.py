"""Process helpers shared by the daemons and their batch processes."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

PARENT_ENV = "DPEX_PARENT_PID"


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a process killed an instant
    ago may not have been reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def remove_dead_dirs(root: str, pattern: str) -> None:
    """Removes the directories in ``root`` whose names match ``pattern`` (its
    first group: the owner's pid) and whose process is gone (killed before it
    could remove its own)."""
    try:
        entries = os.listdir(root)
    except OSError:  # no such directory here
        return
    for entry in entries:
        match = re.fullmatch(pattern, entry)
        if match and not alive(int(match.group(1))):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def owner_pid(name: str) -> int | None:
    """The pid of the process that owns a Dpex directory named ``name`` (a
    hand-off directory ``dpex-PID`` in /dev/shm, a ``dpex-KIND-PID-…`` temp
    directory), else None."""
    match = re.fullmatch(r"dpex-(?:[a-z]+-)?(\d+)(?:-.+)?", name)
    return int(match.group(1)) if match else None


def remove_dead_temp_dirs(kind: str) -> None:
    """Removes the ``dpex-KIND-PID-*`` directories of dead processes in the temp directory."""
    remove_dead_dirs(tempfile.gettempdir(), rf"dpex-{kind}-(\d+)-.+")


def temp_dir(kind: str) -> str:
    """A new directory of this process in the temp directory, named after its
    pid (``dpex-KIND-PID-…``); those of dead processes go first."""
    remove_dead_temp_dirs(kind)
    return tempfile.mkdtemp(prefix=f"dpex-{kind}-{os.getpid()}-")


def flush_stdio() -> None:
    """Flushes sys.stdout and sys.stderr, whatever they are (closed, replaced,
    None): before a fork (else their buffers are written twice) and before os._exit."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):
            pass


def output_to(log_path: str) -> None:
    """In a forked daemon: stdin from /dev/null, stdout and stderr appended to ``log_path``, as
    ``dpex.daemon.spawn`` gives a daemon it starts."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(devnull, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(devnull)
    os.close(log)


def die_with_parent(parent_pid: int | None = None) -> None:
    """Linux: get SIGTERM when the parent process dies (PR_SET_PDEATHSIG).

    Set by the process itself, after exec, so that its starter need not fork
    with a preexec_fn while gRPC threads run. If the parent is already gone
    (it was ``parent_pid``), exit now.
    """
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent_from_env() -> None:
    """Applies die_with_parent() when a LocalCluster started this process."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent:
        die_with_parent(int(parent))


def _mallopt() -> Any:
    try:
        return ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return None


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4


def reuse_freed_memory(keep_mb: int = 256) -> None:
    """glibc: serve big buffers from the heap and keep up to ``keep_mb`` of
    freed heap, for the worker daemon, which reads, sends and frees a frame
    per batch. By default a buffer over 32 MiB is a fresh mapping each time,
    page-faulted in and zeroed (a 36.8 MB float32 frame cost as much in faults
    as in copying); now one frame's buffer is reused by the next."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_MAX, 0)
        mallopt(_M_TRIM_THRESHOLD, keep_mb << 20)


def map_big_buffers(threshold_mb: int = 1, keep_mb: int = 64) -> None:
    """glibc: buffers of ``threshold_mb`` or more are always their own
    mappings, for the batch processes. glibc's default raises that threshold
    to the size of the first big buffer freed, after which batches live in
    the heap, and the small objects user code keeps (an epoch's RNG states)
    split the hole a batch leaves: a process grew by one batch per epoch.

    Fixing that threshold also fixes the trim threshold at its 128 KB default
    (glibc raises both together): every image-sized buffer freed at the
    heap's top went back to the kernel and was faulted in again by the next
    sample, a third of a batch process's CPU on a JPEG pipeline. Up to
    ``keep_mb`` of freed heap is kept, glibc's own ceiling when it adapts."""
    mallopt = _mallopt()
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, threshold_mb << 20)
        mallopt(_M_TRIM_THRESHOLD, keep_mb << 20)


class ChildProcess:
    """What a LocalCluster needs of a ``subprocess.Popen`` (``pid``, ``returncode``, ``poll``, ``wait``,
    signals), for a process started otherwise: a subclass says how its end is learnt (``_collect``)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _collect(self, timeout: float) -> None:
        """Sets ``returncode`` if the process ends within ``timeout`` seconds."""
        raise NotImplementedError

    def poll(self) -> int | None:
        if self.returncode is None:
            self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 0.05 if deadline is None else min(deadline - time.monotonic(), 0.05)
            if left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)  # type: ignore[arg-type]
            self._collect(left)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # it ended (and was reaped elsewhere) before its end was learnt, as Popen
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

