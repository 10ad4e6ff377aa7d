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


def finish_interpreter() -> None:
    """What Python does at exit before it tears its modules down, for a forked child that ends with
    ``os._exit``: waits for the threads that are not daemons (``threading._shutdown``), then runs the
    exit handlers (``atexit._run_exitfuncs``: logging's, multiprocessing's...)."""
    import atexit
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
