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
