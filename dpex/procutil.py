"""Process helpers shared by the daemons and their batch processes."""
from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "DPEX_PARENT_PID"


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


def reuse_freed_memory(keep_mb: int = 256) -> None:
    """glibc: serve big buffers from the heap and keep up to ``keep_mb`` of
    freed heap, for the processes that handle batches. By default a buffer
    over 32 MiB is a fresh mapping each time, page-faulted in and zeroed
    (a 36.8 MB float32 batch cost as much in faults as in copying); now
    one batch's buffer is reused by the next. A no-op without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4
    mallopt(m_mmap_max, 0)
    mallopt(m_trim_threshold, keep_mb << 20)
