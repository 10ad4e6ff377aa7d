"""A small tmpfs where a test needs one: a Python script run in a mount
namespace of its own (root only), so that the machine's mounts stay as they
are. For a full /dev/shm or a full disk under a daemon."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time


def available() -> bool:
    """Mount namespaces can be made here (root, with util-linux's unshare)."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def run_with_tmpfs(script: str, path: str, size: str, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Runs ``python -c script *args`` with a tmpfs of ``size`` (e.g. "8m")
    mounted on ``path`` for it alone; its output, captured."""
    mount = f"mount -t tmpfs -o size={size} tmpfs {path} && exec {sys.executable} -c \"$0\" \"$@\""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, script, *args],
                          capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)


def exec_with_tmpfs(path: str, size: str, argv: list[str]) -> None:
    """Replaces this process with ``argv`` run with a tmpfs of ``size`` mounted
    on ``path`` (an empty directory, removed at the end) for it alone."""
    mount = (f"mount -t tmpfs -o size={size} tmpfs {path} && {{ \"$@\"; rc=$?; umount {path}; rmdir {path}; "
             "exit $rc; }")
    os.execvp("unshare", ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "sh", *argv])


def fill(directory: str) -> str:
    """Fills the file system of ``directory`` with a file (returned: remove it to give the room back)."""
    path = os.path.join(directory, f"filler-{os.getpid()}-{time.monotonic_ns()}")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:  # ENOSPC: full
            pass
    return path
