"""The suite's Python programs (trainers killed on purpose, Lightning's scripts)
forked from a warm starter that imported their heavy modules once
(dpex.launch.warmstart), instead of each a new interpreter importing them:
Lightning's imports take 4 s of CPU, torch's 1.4 s. ``run`` is
``subprocess.run([sys.executable, *argv], capture_output=True, text=True)``,
``popen`` is ``subprocess.Popen([sys.executable, *argv], ...)``.

What a new interpreter's start itself does (a user's script as they run it, its
imports in their order, environment variables read at import) is tested with
new interpreters, not here."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import tempfile
from typing import Any

from dpex.launch import warmstart

TRAINER = ("torch", "numpy", "grpc", "cloudpickle", "dpex")  # a trainer's imports
LIGHTNING = (*TRAINER, "pytorch_lightning")


class Program:
    """A program ``popen`` started, as a ``subprocess.Popen``: ``pid``, ``returncode``, ``poll``, ``wait``,
    signals and ``stdin``/``stdout``/``stderr`` (None unless piped)."""

    def __init__(self, process: warmstart.WarmProcess, stdin: Any, stdout: Any, stderr: Any) -> None:
        self._process = process
        self.pid = process.pid
        self.stdin, self.stdout, self.stderr = stdin, stdout, stderr

    def __getattr__(self, name: str) -> Any:  # returncode, poll, wait, send_signal, terminate, kill
        return getattr(self._process, name)


def popen(argv: list[str], *, stdin: int | None = None, stdout: int | None = None, stderr: int | None = None,
          text: bool = False, cwd: str | None = None, env: dict[str, str] | None = None,
          preload: tuple[str, ...] = TRAINER, session: bool = False, netns: str | None = None) -> "Program":
    """``python ARGV`` (``-c CODE ARGS``, ``-m MODULE ARGS``, ``SCRIPT ARGS``) forked from the warm
    starter of ``preload``, as ``subprocess.Popen``: each stream None (this process's), ``subprocess.PIPE``
    or ``subprocess.DEVNULL``; in the network namespace ``netns`` if given (as ``ip netns exec``)."""
    theirs, ours = [], []
    try:
        for target, how in enumerate((stdin, stdout, stderr)):
            if how == subprocess.PIPE:
                read, write = os.pipe()
                theirs.append(read if target == 0 else write)
                ours.append(write if target == 0 else read)
            elif how == subprocess.DEVNULL:
                theirs.append(os.open(os.devnull, os.O_RDWR))
                ours.append(None)
            elif how is None:
                theirs.append(os.dup(target))
                ours.append(None)
            else:
                raise ValueError(f"a stream is None, subprocess.PIPE or subprocess.DEVNULL, not {how!r}")
    except BaseException:
        for fd in [*theirs, *ours]:
            if fd is not None:
                os.close(fd)
        raise
    try:
        child = _start(argv, theirs, cwd, env, preload, netns, session)
    except BaseException:
        for fd in ours:
            if fd is not None:
                os.close(fd)
        raise
    streams = [None if fd is None else os.fdopen(fd, "wb" if i == 0 else "rb") for i, fd in enumerate(ours)]
    if text:
        streams = [None if f is None else io.TextIOWrapper(f, write_through=True) for f in streams]
    return Program(child, *streams)


def run(argv: list[str], *, cwd: str | None = None, env: dict[str, str] | None = None,
        timeout: float | None = None, preload: tuple[str, ...] = TRAINER,
        netns: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, stdin=DEVNULL,
    timeout=timeout)`` forked from the warm starter of ``preload`` (in the network namespace ``netns`` if
    given): on a timeout the program is killed and ``subprocess.TimeoutExpired`` raised."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        stdio = [os.open(os.devnull, os.O_RDONLY), os.dup(out.fileno()), os.dup(err.fileno())]
        child = _start(argv, stdio, cwd, env, preload, netns)
        try:
            code = child.wait(timeout)
        finally:
            if child.poll() is None:  # timed out or interrupted: it goes too, as subprocess.run's child
                child.send_signal(signal.SIGKILL)
                child.wait()
        outputs = []
        for f in (out, err):
            f.seek(0)
            outputs.append(f.read().decode(errors="replace"))
    return subprocess.CompletedProcess(list(argv), code, *outputs)


def _start(argv: list[str], stdio: list[int], cwd: str | None, env: dict[str, str] | None,
           preload: tuple[str, ...], netns: str | None, session: bool = False) -> warmstart.WarmProcess:
    """``python ARGV`` forked by the warm starter of ``preload`` with ``stdio`` as its stdin, stdout and
    stderr; closes ``stdio`` here (the child has them)."""
    try:
        return warmstart.starter(preload).start(list(argv), dict(os.environ if env is None else env),
                                                tuple(stdio), session=session, cwd=cwd, netns=netns)  # type: ignore[arg-type]
    finally:
        for fd in stdio:
            os.close(fd)
