"""Dpex's commands as a test runs them: the ones installed beside this Python."""
from __future__ import annotations

import os
import subprocess
import sys

BIN = os.path.dirname(sys.executable)


def command(name: str) -> str:
    """The path of command ``name`` (``dpex``, ``dpex-worker``, ``torchrun``...)."""
    return os.path.join(BIN, name)


def run(*args: str, env: dict | None = None, unset: tuple[str, ...] = (),
        timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs command ``args[0]`` with ``args[1:]`` to its end, its output captured as text;
    the environment is ours with ``env`` added and the names in ``unset`` removed."""
    environ = {k: v for k, v in os.environ.items() if k not in unset}
    return subprocess.run([command(args[0]), *args[1:]], capture_output=True, text=True, timeout=timeout,
                          env={**environ, **(env or {})})
