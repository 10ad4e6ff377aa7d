"""A warm starter: one process per starter process that has imported torch,
gRPC and Dpex's daemons once, and forks each daemon a ``LocalCluster(warm_start=True)``
starts, as multiprocessing's forkserver forks its children. A worker then serves
in a fraction of a second, not after a cold interpreter's imports (torch's alone
take a second of CPU).

The child runs ``python -m MODULE ARGS`` as a new interpreter would: the
environment, working directory, arguments and log it is given, its own session
if asked, signals at their defaults, the random generators reseeded. What
modules read from the environment when imported (torch, gRPC) is the starter's.

The protocol, JSON lines on a socket pair: ``{"start": {module, args, env, cwd,
log, session}}`` is answered ``{"pid": N}`` or ``{"error": why}``; ``{"exited": N,
"code": C}`` follows when the child ends (C as ``Popen.returncode``). The starter
exits when its socket closes (its starter ended) or its parent dies, and its
children then get SIGTERM (their parent-death signal, as a LocalCluster's
daemons have).
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from dpex.procutil import PARENT_ENV, ChildProcess, alive, die_with_parent_from_env, flush_stdio, output_to

PRELOAD = ("torch", "numpy", "grpc", "cloudpickle", "dpex.cmd.worker", "dpex.cmd.dispatcher",
           "dpex.worker.server", "dpex.worker.daemon", "dpex.dispatcher.server")


# ---- the starter's side --------------------------------------------------------------------
class WarmProcess(ChildProcess):
    """A child of the warm starter, as a ``subprocess.Popen``: its end comes from the starter."""

    def __init__(self, pid: int, starter: "WarmStarter") -> None:
        super().__init__(pid)
        self._starter = starter

    def _collect(self, timeout: float) -> None:
        self._starter.pump(timeout)


class WarmStarter:
    """The client of one warm starter process (see the module's note)."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dpex.launch.warmstart", str(theirs.fileno())], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env={**os.environ, PARENT_ENV: str(os.getpid())})
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._buf = b""
        self._lock = threading.Lock()  # one reader of the socket at a time
        self._children: dict[int, WarmProcess] = {}
        self._replies: list[dict[str, Any]] = []
        self.lost = False
        hello = self._next(timeout=120.0)
        if hello is None or "ready" not in hello:
            self.close()
            raise OSError(f"the warm starter did not start: {hello}")

    def start(self, module: str, args: list[str], env: dict[str, str], log_path: str,
              session: bool = False) -> WarmProcess:
        """Forks ``python -m MODULE ARGS`` (output appended to ``log_path``)."""
        request = {"module": module, "args": args, "env": env, "cwd": os.getcwd(), "log": log_path, "session": session,
                   "ignored": _ignored_signals()}
        with self._lock:
            if self.lost:
                raise OSError("the warm starter is gone")
            self._sock.sendall(json.dumps({"start": request}).encode() + b"\n")
            while not self._replies:
                if not self._read(None):
                    raise OSError("the warm starter is gone")
            reply = self._replies.pop(0)
            if "error" in reply:
                raise OSError(f"the warm starter could not start {module}: {reply['error']}")
            process = self._children[reply["pid"]] = WarmProcess(reply["pid"], self)
            return process

    def pump(self, timeout: float) -> None:
        """Reads what the starter reported within ``timeout`` seconds (children's ends)."""
        if not self._lock.acquire(timeout=max(timeout, 0.001)):
            return
        try:
            if self.lost:  # their ends are not reported any more: a child that is gone ended by SIGTERM
                for pid, child in list(self._children.items()):
                    if not alive(pid):
                        child.returncode = -signal.SIGTERM
                        del self._children[pid]
                return
            self._read(timeout)
        finally:
            self._lock.release()

    def _read(self, timeout: float | None) -> bool:
        """Reads one message if one comes within ``timeout``; False once the starter is gone."""
        message = self._next(timeout)
        if message is None:
            return not self.lost
        if "exited" in message:
            child = self._children.pop(message["exited"], None)
            if child is not None:
                child.returncode = message["code"]
        else:
            self._replies.append(message)
        return True

    def _next(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message, or None if none comes within ``timeout`` or the starter is gone."""
        message, self._buf, self.lost = _receive(self._sock, self._buf, timeout)
        return message

    def close(self) -> None:
        """Ends the starter (its children then get SIGTERM)."""
        self.lost = True
        self._sock.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# Python ignores these itself at start (a child of Popen has them at their defaults until then).
_PYTHONS_OWN = (signal.SIGPIPE, signal.SIGXFSZ)


def _ignored_signals() -> list[int]:
    """The signals this process ignores: a process it starts ignores them too (nohup's SIGHUP, a shell's
    SIGINT for a background job), and Python then leaves SIGINT ignored."""
    return [int(sig) for sig in signal.valid_signals()
            if sig not in _PYTHONS_OWN and signal.getsignal(sig) == signal.SIG_IGN]


def _signals_as_started(ignored: list[int]) -> None:
    """In the child: the signals as a new interpreter started by the starter's own process has them."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig in ignored or sig in _PYTHONS_OWN:
            want: Any = signal.SIG_IGN
        else:
            want = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        try:
            if signal.getsignal(sig) != want:
                signal.signal(sig, want)
        except (OSError, ValueError):  # one Python cannot set
            pass


_starter: WarmStarter | None = None
_starter_lock = threading.Lock()


def starter() -> WarmStarter:
    """This process's warm starter, started at the first call (again if it died)."""
    global _starter
    with _starter_lock:
        if _starter is None or _starter.lost or _starter.process.poll() is not None:
            _starter = WarmStarter()
        return _starter


def available() -> bool:
    """Whether daemons can be warm-started here (Linux's fork)."""
    return hasattr(os, "fork") and sys.platform.startswith("linux")


def _receive(sock: socket.socket, buf: bytes, timeout: float | None) -> tuple[dict[str, Any] | None, bytes, bool]:
    """(the next JSON line or None, what is left of ``buf``, whether the peer is gone)."""
    while b"\n" not in buf:
        if timeout is not None and not select.select([sock], [], [], timeout)[0]:
            return None, buf, False
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None, buf, True
        buf += chunk
    line, _, buf = buf.partition(b"\n")
    return json.loads(line), buf, False


# ---- the warm starter process --------------------------------------------------------------
def _serve(fd: int) -> None:
    die_with_parent_from_env()  # its starter died: so does it, and its children after it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for its children, who are in its group
    sock = socket.socket(fileno=fd)
    for name in PRELOAD:
        __import__(name)
    import gc
    gc.freeze()  # what the imports made stays shared with every child
    from dpex.daemon import can_fork
    if not can_fork():  # a gRPC thread's locks would be held in the child (OpenBLAS's handle fork)
        sock.sendall(b'{"error": "gRPC runs threads in the starter"}\n')
        return
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    sock.sendall(b'{"ready": true}\n')
    buf = b""
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:  # a child ended: reaped below
            os.read(wake_r, 512)
        if sock in ready:
            chunk = sock.recv(1 << 16)
            if not chunk:  # its starter ended
                return
            buf += chunk
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                try:
                    reply = {"pid": _fork(json.loads(line)["start"], (fd, wake_r, wake_w))}
                except OSError as e:
                    reply = {"error": str(e)}
                sock.sendall(json.dumps(reply).encode() + b"\n")
        _reap(sock)


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            return
        sock.sendall(json.dumps({"exited": pid, "code": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


def _fork(request: dict[str, Any], fds: tuple[int, ...]) -> int:
    flush_stdio()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run(request, fds)
    except BaseException:  # noqa: BLE001 - reported in its log
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)
    return 0  # not reached


def _run(request: dict[str, Any], fds: tuple[int, ...]) -> int:
    """In the child: becomes ``python -m MODULE ARGS`` and runs it; returns its exit code."""
    import atexit
    import importlib
    import logging
    import multiprocessing
    import runpy
    import tempfile

    signal.set_wakeup_fd(-1)
    for fd in fds:
        os.close(fd)
    _signals_as_started(request["ignored"])
    if request["session"]:
        os.setsid()
    output_to(request["log"])
    os.chdir(request["cwd"])
    env = dict(request["env"])
    if PARENT_ENV in env:  # its parent is the starter, which ends with theirs
        env[PARENT_ENV] = str(os.getppid())
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # as TMPDIR says now
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[0:1] = [request["cwd"], *added]  # as `python -m` puts them
    importlib.invalidate_caches()  # files written since the starter looked
    multiprocessing.current_process().authkey = os.urandom(32)  # its own, as a new interpreter's
    import numpy
    import torch
    numpy.random.seed()  # each its own seed, as a new interpreter's (random's is reseeded at every fork)
    torch.seed()
    sys.argv = [request["module"], *request["args"]]
    code: Any = 0
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    logging.shutdown()
    return code


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
