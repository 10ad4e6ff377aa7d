"""A warm starter: one process per starter process that has imported torch,
gRPC and Dpex's daemons once, and forks each daemon a ``LocalCluster(warm_start=True)``
starts, as multiprocessing's forkserver forks its children. A worker then serves
in a fraction of a second, not after a cold interpreter's imports (torch's alone
take a second of CPU). A starter with other modules preloaded (Lightning) starts
the suite's programs the same way (``dpex.testing.programs``).

The child runs ``python ARGV`` (``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT
ARGS``) as a new interpreter would: the environment, working directory,
arguments and output it is given (``sys.stdout`` buffered as Python buffers it
there, flushed at its end), its own session if asked, the signals a new
interpreter would have, the random generators reseeded, ``sys.argv``,
``sys.path`` and ``__main__`` as Python sets them, its threads waited for and
its exit handlers run at its end. What modules read from the environment when
imported (torch, gRPC), and Python's own start-up flags, are the starter's.

The protocol, JSON lines on a socket pair: ``{"start": {argv, env, cwd, log,
session, ignored, netns}}`` is answered ``{"pid": N}`` or ``{"error": why}``; a request
whose ``log`` is null carries the child's stdin, stdout and stderr as file
descriptors (SCM_RIGHTS). ``{"exited": N, "code": C}`` follows when the child
ends (C as ``Popen.returncode``). The starter exits when its socket closes (its
starter ended) or its parent dies, and its children then get SIGTERM (their
parent-death signal, as a LocalCluster's daemons have).
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

from dpex import finalizers
from dpex.procutil import PARENT_ENV, ChildProcess, alive, die_with_parent_from_env, flush_stdio, output_to
from dpex.stdlib import finish_interpreter

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

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "dpex.launch.warmstart", str(theirs.fileno()), *preload],
                pass_fds=[theirs.fileno()],
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

    def start(self, argv: list[str], env: dict[str, str], output: str | tuple[int, int, int],
              session: bool = False, cwd: str | None = None, netns: str | None = None) -> WarmProcess:
        """Forks ``python ARGV``: ``-m MODULE ARGS``, ``-c CODE ARGS`` or ``SCRIPT ARGS``.

        Args:
            argv: what follows ``python`` on its command line.
            env: its whole environment.
            output: a log file its stdout and stderr are appended to (stdin: /dev/null), or its
                stdin, stdout and stderr as file descriptors (the caller closes its own).
            session: in a session of its own.
            cwd: its working directory; None: this process's.
            netns: (root) the network namespace it runs in, by its ``ip netns`` name, as under
                ``ip netns exec NAME`` (only the network: not that command's /etc/netns files)."""
        logged = isinstance(output, str)
        request = {"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "log": output if logged else None,
                   "session": session, "ignored": _ignored_signals(), "netns": netns}
        line = json.dumps({"start": request}).encode() + b"\n"
        with self._lock:
            if self.lost:
                raise OSError("the warm starter is gone")
            if logged:
                self._sock.sendall(line)
            else:  # the descriptors go with the message's first bytes
                sent = socket.send_fds(self._sock, [line], list(output))  # type: ignore[arg-type]
                self._sock.sendall(line[sent:])
            while not self._replies:
                if not self._read(None):
                    raise OSError("the warm starter is gone")
            reply = self._replies.pop(0)
            if "error" in reply:
                raise OSError(f"the warm starter could not start python {' '.join(argv)[:80]}: {reply['error']}")
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


_starters: dict[tuple[str, ...], WarmStarter] = {}
_starter_lock = threading.Lock()


def _lives(starter: WarmStarter | None) -> bool:
    return starter is not None and not starter.lost and starter.process.poll() is None


def starter(preload: tuple[str, ...] = PRELOAD) -> WarmStarter:
    """This process's warm starter of the modules ``preload``, started at the first call (again if it died)."""
    with _starter_lock:
        if not _lives(_starters.get(preload)):
            _starters[preload] = WarmStarter(preload)
        return _starters[preload]


def _close_all() -> None:
    """At exit: this process's starters end (as they would when it ends), and are waited for."""
    with _starter_lock:
        starters = list(_starters.values())
        _starters.clear()
    for each in starters:
        each.close()


finalizers.register_at_exit(_close_all)


def running() -> bool:
    """Whether this process has a warm starter of the daemons that lives (a ``LocalCluster(warm_start=True)``
    started it)."""
    with _starter_lock:
        return _lives(_starters.get(PRELOAD))


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
def _serve(fd: int, preload: list[str]) -> None:
    die_with_parent_from_env()  # its starter died: so does it, and its children after it
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for its children, who are in its group
    sock = socket.socket(fileno=fd)
    for name in preload:
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
    buf, passed = b"", []  # one start is in flight at a time: the descriptors received are its own
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:  # a child ended: reaped below
            os.read(wake_r, 512)
        if sock in ready:
            chunk, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
            if not chunk:  # its starter ended
                return
            buf, passed = buf + chunk, passed + fds
            while b"\n" in buf:
                line, _, buf = buf.partition(b"\n")
                request = json.loads(line)["start"]
                stdio, passed = (passed, []) if request["log"] is None else ([], passed)
                try:
                    reply = {"pid": _fork(request, stdio, (fd, wake_r, wake_w))}
                except OSError as e:
                    reply = {"error": str(e)}
                finally:
                    for passed_fd in stdio:
                        os.close(passed_fd)
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


def _fork(request: dict[str, Any], stdio: list[int], fds: tuple[int, ...]) -> int:
    if request["log"] is None and len(stdio) != 3:
        raise OSError(f"{len(stdio)} file descriptors came with the request, not 3 (stdin, stdout, stderr)")
    flush_stdio()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _run(request, stdio, fds)
    except BaseException:  # noqa: BLE001 - reported in its log
        import traceback
        traceback.print_exc()
    finally:
        flush_stdio()  # as Python's finalization, after the exit handlers
        os._exit(code)
    return 0  # not reached


def _run(request: dict[str, Any], stdio: list[int], fds: tuple[int, ...]) -> int:
    """In the child: becomes ``python ARGV`` and runs it; returns its exit code."""
    import importlib
    import multiprocessing
    import multiprocessing.process
    import tempfile

    signal.set_wakeup_fd(-1)
    for fd in fds:
        os.close(fd)
    _signals_as_started(request["ignored"])
    if request["session"]:
        os.setsid()
    if request["log"] is not None:
        output_to(request["log"])
    for target, fd in enumerate(stdio):
        os.dup2(fd, target)
        os.close(fd)
    env = dict(request["env"])
    _stdio_as_started(bool(env.get("PYTHONUNBUFFERED")))
    if request.get("netns"):
        _enter_netns(request["netns"])
    cwd = request["cwd"]
    os.chdir(cwd)
    multiprocessing.process.ORIGINAL_DIR = cwd  # where a spawned child finds a relative __main__
    if PARENT_ENV in env:  # its parent is the starter, which ends with theirs
        env[PARENT_ENV] = str(os.getppid())
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # as TMPDIR says now
    importlib.invalidate_caches()  # files written since the starter looked
    multiprocessing.current_process().authkey = os.urandom(32)  # its own, as a new interpreter's
    if "numpy" in sys.modules:  # each its own seed, as a new interpreter's (random's is reseeded at every fork)
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        torch.seed()
        # The threads a new interpreter's torch would use: OpenMP read the starter's variable at import
        # (without one in its environment, the child keeps the starter's).
        threads = env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
    code: Any = 0
    interrupted = False
    try:
        _run_main(request["argv"], [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 - uncaught: printed as Python prints it, from the program's frames
        e.__traceback__ = _programs_frames(e.__traceback__)  # the one Python prints
        sys.excepthook(type(e), e, e.__traceback__)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    finish_interpreter()
    if interrupted:  # Python then ends by the signal, as a shell expects of an interrupted program
        flush_stdio()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _stdio_as_started(unbuffered: bool) -> None:
    """In the child: ``sys.stdin``, ``sys.stdout`` and ``sys.stderr`` made again on descriptors 0-2, as a new
    interpreter makes them (``create_stdio``): the starter's were made on /dev/null. Unbuffered under
    PYTHONUNBUFFERED; else stdout line-buffered at a terminal (block-buffered on a pipe or file), stderr
    line-buffered; the starter's encodings."""
    import io
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, f"__{name}__")
        if old is None:
            continue
        writes = fd > 0
        binary = io.open(fd, "wb" if writes else "rb", buffering=0 if writes and unbuffered else -1, closefd=False)
        stream = io.TextIOWrapper(binary, encoding=old.encoding, errors=old.errors, newline="\n",
                                  line_buffering=not unbuffered and (fd == 2 or os.isatty(fd)),
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _enter_netns(name: str) -> None:
    """Moves this (single-threaded) process into the network namespace ``ip netns`` calls ``name``."""
    import ctypes
    fd = os.open(os.path.join("/run/netns", name), os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter the network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


def _run_main(argv: list[str], pythonpath: list[str]) -> None:
    """Runs ``python ARGV`` here, with ``sys.argv``, ``sys.path[0]`` and ``__main__`` as Python sets them."""
    import runpy
    added = [p for p in pythonpath if p not in sys.path]
    if argv[0] == "-m":
        sys.path[0:1] = [os.getcwd(), *added]
        sys.argv = argv[1:]  # runpy puts the module's file first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.path[0:1] = ["", *added]
        sys.argv = ["-c", *argv[2:]]
        _exec_as_main(compile(argv[1], "<string>", "exec"))
    else:
        import importlib.machinery
        script = os.path.abspath(argv[0])
        sys.path[0:1] = [os.path.dirname(os.path.realpath(script)), *added]
        sys.argv = list(argv)
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec")
        _exec_as_main(code, __file__=script, __cached__=None,
                      __loader__=importlib.machinery.SourceFileLoader("__main__", script))


def _exec_as_main(code: Any, **attributes: Any) -> None:
    """Runs ``code`` as the module ``__main__``, a new one, as Python runs a script or ``-c``."""
    import builtins
    import types
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    for name, value in attributes.items():
        setattr(main, name, value)
    sys.modules["__main__"] = main
    exec(code, main.__dict__)


def _programs_frames(tb: Any) -> Any:
    """A traceback without its first frames here and in runpy (a new interpreter has none)."""
    import runpy
    ours = (_programs_frames.__code__.co_filename, runpy.run_module.__code__.co_filename)
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    return tb


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2:])
