"""The private parts of Python's standard library that Dpex relies on, each
behind one helper here and nowhere else. tests/unit/test_stdlib.py checks
each against the running Python, so that a release that changes one fails
a test, not a user's job."""
from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from typing import Any


def executor_processes(executor: ProcessPoolExecutor) -> list[Any]:
    """The processes an executor has started (``_processes``: pid -> Process)."""
    return list((executor._processes or {}).values())  # type: ignore[attr-defined] (None once shut down)


def start_executor_processes(executor: ProcessPoolExecutor) -> None:
    """Starts all of an executor's processes now, as a forking executor does
    at its first task (``_launch_processes``): from a process with no other
    thread yet, before the executor's manager thread exists."""
    executor._launch_processes()  # type: ignore[attr-defined]


def set_multiprocessing_tempdir(path: str) -> None:
    """Where multiprocessing puts its sockets and files (a forkserver's), if
    it has not chosen yet: ``current_process()._config["tempdir"]``."""
    multiprocessing.current_process()._config.setdefault("tempdir", path)  # type: ignore[attr-defined]


def forget_forkserver() -> None:
    """In a forked child: the parent's forkserver is not this process's, so
    forget it (its address, pid and fds in ``forkserver._forkserver``); a new
    one starts when this process needs it (multiprocessing would wait for the
    parent's and fail)."""
    import multiprocessing.forkserver as forkserver
    server = forkserver._forkserver  # type: ignore[attr-defined]
    fields = ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid", "_inherited_fds", "_lock")
    missing = [name for name in fields if not hasattr(server, name)]
    if missing:  # setting them would do nothing: this Python's forkserver keeps them elsewhere
        raise RuntimeError(f"multiprocessing.forkserver has no {', '.join(missing)}: Dpex needs an update")
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._inherited_fds = None
    server._lock = threading.Lock()


def fork_forkserver() -> None:
    """Starts multiprocessing's forkserver for this process as a fork of it, not a new interpreter
    (``ForkServer.ensure_running`` spawns one, which imports its preloaded modules again): its children
    have at once what this process imported. Only while this process runs one thread. The server holds
    its socket, the "alive" pipe and stdio, as a spawned one; this process's other descriptors are closed
    there. Sets the fields ``ensure_running`` sets (``_forkserver_address``, ``_alive_fd``, ``_pid``)."""
    import gc
    import os
    import socket
    from multiprocessing import connection, forkserver, util
    server = forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:  # (multiprocessing's resource tracker starts with the first child, as it would)
        if server._forkserver_pid is not None:
            return
        with socket.socket(socket.AF_UNIX) as listener:
            address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
            listener.bind(address)
            if not util.is_abstract_socket_namespace(address):  # as ensure_running
                os.chmod(address, 0o600)
            listener.listen()
            alive_r, alive_w = os.pipe()  # the server ends when every holder of alive_w has
            try:
                pid = os.fork()
                if pid == 0:
                    try:
                        gc.freeze()  # objects whose descriptors are closed below are never collected here
                        keep = {0, 1, 2, listener.fileno(), alive_r}
                        for fd in [int(fd) for fd in os.listdir("/proc/self/fd")]:
                            if fd not in keep:
                                try:
                                    os.close(fd)
                                except OSError:  # listdir's own, gone already
                                    pass
                        forkserver.main(listener.fileno(), alive_r, [])
                    finally:
                        os._exit(0)
            except BaseException:
                os.close(alive_w)
                raise
            finally:
                os.close(alive_r)
        server._forkserver_address = address
        server._forkserver_alive_fd = alive_w
        server._forkserver_pid = pid


def stop_forkserver(timeout_s: float) -> None:
    """Stops this process's forkserver, if it has one, as ``ForkServer._stop`` does (closes the "alive"
    pipe, reaps the server, removes its socket), waiting at most ``timeout_s`` before it kills it (a
    child of the server that still runs holds the pipe open)."""
    import os
    import signal
    import time
    from multiprocessing import forkserver, util
    server = forkserver._forkserver  # type: ignore[attr-defined]
    with server._lock:
        pid = server._forkserver_pid
        if pid is None:
            return
        os.close(server._forkserver_alive_fd)
        deadline = time.monotonic() + timeout_s
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.01)
        if not util.is_abstract_socket_namespace(server._forkserver_address):
            try:
                os.unlink(server._forkserver_address)
            except FileNotFoundError:  # gone with its directory
                pass
        server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None


def finish_interpreter() -> None:
    """What Python does at exit before it tears its modules down, for a forked child that ends with
    ``os._exit``: waits for the threads that are not daemons (``threading._shutdown``), then runs the
    exit handlers (``atexit._run_exitfuncs``: logging's, multiprocessing's...)."""
    import atexit
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
