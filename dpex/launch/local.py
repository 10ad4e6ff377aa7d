"""LocalCluster: a dispatcher and workers as local processes on loopback ports."""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import threading
import weakref
from typing import Any, Callable

from dpex.config import DispatcherConfig, WorkerConfig
from dpex.errors import DpexConfigError, DpexError, DpexWorkerError
from dpex.auth import TOKEN_ENV
from dpex.daemon import Daemon, await_ready, can_fork, exit_reason, spawn, stop_process
from dpex.launch.forked import ForkedProcess, fork_worker
from dpex.procutil import PARENT_ENV, remove_dead_temp_dirs, temp_dir
from dpex import shm

_log = logging.getLogger("dpex.launch")

START_TIMEOUT_S = 120.0  # how long a daemon may take to serve, however loaded the machine


class _Processes:
    """A LocalCluster's daemons, shared with its finalizer: the workers, the
    dispatcher and those still starting, which the finalizer stops too; once it
    ran (``closed``), nothing starts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.workers: list[Daemon] = []
        self.dispatcher: Daemon | None = None
        self.starting: set[Any] = set()
        self.closed = False

    def set_dispatcher(self, daemon: Daemon) -> None:
        self.dispatcher = daemon


class LocalCluster:
    """Starts ``dpex-dispatcher`` and ``num_workers`` ``dpex-worker`` processes.

    The cluster stops on :meth:`close`, on garbage collection, at interpreter
    exit, and (Linux) when the starting process dies. Daemon logs go to
    ``log_dir``. The keyword arguments are the daemons' flags; ``auth_token``
    travels in their environment, ``tls`` is (certificate, key, CA) files;
    ``metrics`` gives every daemon a Prometheus endpoint (``Daemon.metrics_url``);
    ``dispatcher_flags`` / ``worker_flags`` are more command-line flags for them;
    ``drain_timeout_s`` is how long a worker answers in-flight calls when stopped;
    ``log_dir`` (default: a new temporary directory) is removed on close;
    ``own_session`` starts the daemons in a session of their own, out of
    reach of a Ctrl-C (SIGINT) to the starter's process group: they stop with
    the starter, which may ignore SIGINT (a background job) or handle it.
    """

    def __init__(self, num_workers: int = 1, processes: int = 1, *, host: str = "127.0.0.1",
                 heartbeat_interval_s: float = DispatcherConfig.heartbeat_interval_s,
                 heartbeat_timeout_s: float = DispatcherConfig.heartbeat_timeout_s,
                 split_size_batches: int = DispatcherConfig.split_size_batches, buffer_batches: int | None = None,
                 work_dir: str | None = None, consumer_timeout_s: float = DispatcherConfig.consumer_timeout_s, auth_token: str | None = None,
                 tls: tuple[str, str, str] | None = None, metrics: bool = False,
                 dispatcher_flags: tuple[str, ...] = (), worker_flags: tuple[str, ...] = (),
                 start_timeout_s: float = START_TIMEOUT_S, env: dict[str, str] | None = None,
                 drain_timeout_s: float = WorkerConfig.drain_timeout_s, log_dir: str | None = None,
                 own_session: bool = False) -> None:
        if num_workers < 0 or processes < 1:
            raise DpexConfigError("num_workers must be >= 0 and processes >= 1")
        self.host = host
        self._processes = processes
        self._hb = (heartbeat_interval_s, heartbeat_timeout_s)
        self._buffer_batches = buffer_batches
        self._drain_timeout_s = drain_timeout_s
        self._start_timeout_s = start_timeout_s
        self._own_session = own_session
        # The daemons set their parent-death signal themselves (dpex.procutil).
        self._env = {**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())}
        if auth_token:  # through the environment: a command line is visible to every user
            self._env[TOKEN_ENV] = auth_token
        # tls = (certificate, key, CA) files: both daemons serve TLS, workers verify the dispatcher.
        self._tls_args = ["--tls-cert", tls[0], "--tls-key", tls[1]] if tls else []
        self._tls_ca_args = ["--tls-ca", tls[2]] if tls else []
        self._metrics_args = ["--metrics-port", "0"] if metrics else []
        self._worker_flags = list(worker_flags)
        self.log_dir = log_dir or temp_dir("cluster")  # named by pid: removed by a later cluster if we are killed
        self._count = 0
        self._procs = _Processes()  # shared with the finalizer
        self._finalizer = weakref.finalize(self, LocalCluster._close_all, self._procs, self.log_dir)
        try:
            self._dispatcher_args = [
                "dpex.cmd.dispatcher", "--host", host,
                "--heartbeat-interval", str(heartbeat_interval_s),
                "--heartbeat-timeout", str(heartbeat_timeout_s),
                "--split-size", str(split_size_batches), "--consumer-timeout", str(consumer_timeout_s),
            ] + (["--work-dir", work_dir] if work_dir else []) + self._tls_args + self._metrics_args + list(
                dispatcher_flags)
            self._start("dispatcher", [*self._dispatcher_args, "--port", "0"], self._procs.set_dispatcher)
            self.address = self.dispatcher.address
            self.add_workers(num_workers)
        except BaseException:
            self.close()
            raise

    # ---- daemons --------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str],
               env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str, str]:
        with self._procs.lock:
            if self._procs.closed:
                raise DpexError(f"the cluster is stopping: no {name} starts")
            self._count += 1
            stem = os.path.join(self.log_dir, f"{name}-{self._count}")
            ready, log_path = stem + ".ready", stem + ".log"
            process = spawn(args, ready, log_path, {**self._env, **(env or {})}, start_new_session=self._own_session)
            self._procs.starting.add(process)
        return process, ready, log_path

    def _serving(self, name: str, spawned: tuple[Any, str, str], keep: Callable[[Daemon], None]) -> Daemon:
        """Waits for a daemon ``_spawn`` started to serve, then ``keep``s it in
        the cluster, unless the cluster stopped meanwhile (then it is stopped too)."""
        try:
            daemon = await_ready(name, *spawned, self._start_timeout_s)
        except BaseException:
            with self._procs.lock:
                self._procs.starting.discard(spawned[0])
            raise
        with self._procs.lock:
            self._procs.starting.discard(spawned[0])
            if not self._procs.closed:
                keep(daemon)
                return daemon
        stop_process(daemon.process)
        raise DpexError(f"the cluster stopped while its {name} started")

    def _start(self, name: str, args: list[str], keep: Callable[[Daemon], None]) -> Daemon:
        return self._serving(name, self._spawn(name, args), keep)

    def _worker_args(self, port: int | str = 0) -> list[str]:
        return ["dpex.cmd.worker", "--dispatcher", self.address, "--host", self.host, "--port", str(port),
                "--processes", str(self._processes),
                *(("--buffer-batches", str(self._buffer_batches)) if self._buffer_batches is not None else ()),
                "--heartbeat-interval", str(self._hb[0]), "--drain-timeout", str(self._drain_timeout_s),
                *self._tls_args, *self._tls_ca_args,
                *self._metrics_args, *self._worker_flags]

    def add_workers(self, n: int = 1, env: dict[str, str] | None = None) -> list[Daemon]:
        """Starts ``n`` more workers (in parallel; ``env``: more environment
        variables for them) and waits until they serve."""
        started = [self._spawn("worker", self._worker_args(), env) for _ in range(n)]
        return [self._serving("worker", spawned, self._procs.workers.append) for spawned in started]

    def adopt_worker(self, process: Any, ready: str, log_path: str) -> Daemon:
        """Waits for a worker started elsewhere (an embedded worker forked
        from the trainer) to serve, and stops it with the cluster."""
        with self._procs.lock:
            self._procs.starting.add(process)
        return self._serving("worker", (process, ready, log_path), self._procs.workers.append)

    def kill_worker(self, index: int, sig: int = signal.SIGKILL) -> Daemon:
        """Sends ``sig`` to a worker (default SIGKILL) and waits for it to exit."""
        daemon = self.workers[index]
        daemon.process.send_signal(sig)
        daemon.process.wait()
        return daemon

    def restart_worker(self, index: int, sig: int = signal.SIGKILL) -> Daemon:
        """Kills worker ``index`` and starts a new one on the same address."""
        self.kill_worker(index, sig)
        return self.respawn_worker(index)

    def respawn_worker(self, index: int) -> Daemon:
        """Starts a new worker on the address of worker ``index``, which has
        exited: registered there, it replaces the old one in the dispatcher at
        once (whose splits it takes), and trainers reach it where they were."""
        port = self.workers[index].address.rsplit(":", 1)[1]
        return self._start("worker", self._worker_args(port),
                           lambda daemon: self._procs.workers.__setitem__(index, daemon))

    def restart_dispatcher(self, sig: int = signal.SIGKILL) -> Daemon:
        """Kills the dispatcher (default SIGKILL) and starts it again on the
        same port (and work dir, if any); workers and trainers reconnect."""
        self.stop_dispatcher(sig)
        return self.start_dispatcher()

    def stop_dispatcher(self, sig: int = signal.SIGKILL) -> None:
        """Kills the dispatcher (default SIGKILL); :meth:`start_dispatcher` brings it back."""
        self.dispatcher.process.send_signal(sig)
        self.dispatcher.process.wait()

    def start_dispatcher(self) -> Daemon:
        """Starts a stopped dispatcher again, on its port (and work dir, if any)."""
        port = self.address.rsplit(":", 1)[1]
        return self._start("dispatcher", [*self._dispatcher_args, "--port", port], self._procs.set_dispatcher)

    @property
    def dispatcher(self) -> Daemon:
        assert self._procs.dispatcher is not None
        return self._procs.dispatcher

    @property
    def workers(self) -> list[Daemon]:
        """The workers started, by index (one started again keeps its index)."""
        return self._procs.workers

    @property
    def closed(self) -> bool:
        """Stopping began (close(), collection or interpreter exit): nothing starts any more."""
        return self._procs.closed

    @property
    def worker_addresses(self) -> list[str]:
        return [w.address for w in self.workers if w.process.poll() is None]

    # ---- lifetime -------------------------------------------------------------------
    @staticmethod
    def _close_all(procs: "_Processes", log_dir: str) -> None:
        with procs.lock:
            procs.closed = True
            processes = [d.process for d in procs.workers] + list(procs.starting)
        for process in processes:  # all at once, then wait for each
            if process.poll() is None:
                process.terminate()
        for process in processes:
            stop_process(process)
        if procs.dispatcher is not None:
            stop_process(procs.dispatcher.process)
        shm.remove_dead_dirs()  # a worker killed with SIGKILL could not remove its own
        remove_dead_temp_dirs("worker")
        remove_dead_temp_dirs("dispatcher")
        shutil.rmtree(log_dir, ignore_errors=True)

    def close(self) -> None:
        """Stops every daemon; safe to call more than once."""
        self._finalizer()

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---- the embedded cluster of a trainer process ------------------------------------------
EMBEDDED_LINGER_S = 10.0  # an idle embedded cluster waits this long for the next loader, then stops
SUPERVISE_S = 0.25        # how often the embedded cluster's owner looks for a daemon that died
MAX_RESPAWNS = 3          # embedded workers started again after one died; one more death is an error


class Embedded:
    """A lease on this process's embedded cluster (one dispatcher, one worker of
    ``processes`` processes). The first loader to need one starts it in the
    background, so that constructing a loader does not wait for daemons; the
    loaders of a script (train and validation, a new loader each epoch) share
    it; it stops ``EMBEDDED_LINGER_S`` after the last lease is closed, and at
    interpreter exit."""

    def __init__(self, shared: "_Shared") -> None:
        self._shared: _Shared | None = shared

    @property
    def address(self) -> str:
        """The dispatcher's address, once it serves (waits for the start)."""
        if self._shared is None:
            raise DpexConfigError("this embedded cluster lease is closed")
        return self._shared.address()

    def failure(self) -> BaseException | None:
        """Why the cluster can serve no more (its dispatcher died, or its worker
        died more often than it is started again), or None."""
        return self._shared.failure() if self._shared is not None else None

    def close(self) -> None:
        """Gives the lease back; safe to call more than once."""
        shared, self._shared = self._shared, None
        if shared is not None:
            _release(shared)


class _Shared:
    """One embedded cluster and the thread that owns it: the daemons are its
    children (PR_SET_PDEATHSIG fires when the thread that started a process
    ends), so it lives until the cluster is stopped. With ``fork``, its
    worker is forked from this process at once, in the caller's thread (see
    dpex.launch.forked); the dispatcher is always spawned."""

    def __init__(self, key: tuple[int, str | None, bool], fork: bool) -> None:
        self.key = key
        self.users = 0
        self.idle: threading.Timer | None = None
        self._cluster: LocalCluster | None = None
        self._error: BaseException | None = None
        self._ready, self._stop = threading.Event(), threading.Event()
        self._log_dir = temp_dir("cluster")
        self._forked: tuple[ForkedProcess, str, str] | None = None
        self._respawns = 0
        self._address_pipe = -1
        if fork:
            ready, log_path = (os.path.join(self._log_dir, f"worker-0.{ext}") for ext in ("ready", "log"))
            read, self._address_pipe = os.pipe()
            try:
                self._forked = fork_worker(key[0], read, ready, log_path, key[1]), ready, log_path
            except BaseException:
                os.close(self._address_pipe)
                raise
            finally:
                os.close(read)
        # A daemon thread, so that exit is not held up before stop_embedded() (atexit) stops it.
        self._owner = threading.Thread(target=self._run, name="dpex-embedded", daemon=True)
        self._owner.start()

    def _run(self) -> None:
        processes, token, _ = self.key
        try:
            try:
                # Nobody else uses it: its worker need not drain when it stops.
                # In a session of their own: the trainer decides what a Ctrl-C does (they stop with it).
                self._cluster = LocalCluster(num_workers=0 if self._forked else 1, processes=processes,
                                             auth_token=token, drain_timeout_s=0, log_dir=self._log_dir,
                                             own_session=True, worker_flags=("--in-turn",))
                if self._forked:
                    os.write(self._address_pipe, f"{self._cluster.address}\n".encode())
            finally:
                if self._address_pipe >= 0:
                    os.close(self._address_pipe)  # else (EOF) the forked worker exits
            if self._forked:
                self._cluster.adopt_worker(*self._forked)
        except BaseException as e:  # noqa: BLE001 - raised to every loader that waits for it
            self._error = e
            if self._forked:
                stop_process(self._forked[0])  # type: ignore[arg-type]
        finally:
            self._ready.set()
        while self._error is None and not self._stop.wait(SUPERVISE_S):
            self._supervise()
        self._stop.wait()
        if self._cluster is not None:
            self._cluster.close()
        else:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def _supervise(self) -> None:
        """A daemon that died (the out-of-memory killer, a signal): a worker is
        started again on its address, up to MAX_RESPAWNS times; the
        dispatcher, whose jobs live only in its memory, cannot be. Else the
        cluster fails, with torch's words, and its loaders raise them."""
        cluster = self._cluster
        assert cluster is not None
        dispatcher = cluster.dispatcher.process
        dead = dispatcher.poll() is not None or any(w.process.poll() is not None for w in cluster.workers)
        if not dead or cluster.closed or self._stop.is_set():  # stopping (at exit, its finalizer may come first)
            return
        if dispatcher.poll() is not None:
            self._error = DpexWorkerError(
                f"the embedded Dpex dispatcher {exit_reason(dispatcher.pid, dispatcher.returncode)} "
                f"Its log:\n{cluster.dispatcher.log_tail()}", stage="process")
            return
        for index, worker in enumerate(list(cluster.workers)):
            code = worker.process.poll()
            if code is None:
                continue
            what = f"DataLoader worker {exit_reason(worker.process.pid, code)}"
            if self._respawns >= MAX_RESPAWNS:
                self._error = DpexWorkerError(
                    f"{what} (the embedded Dpex worker, {self._respawns} times started again already). "
                    f"Its log:\n{worker.log_tail()}", stage="process", worker=worker.address)
                return
            self._respawns += 1
            _log.warning("%s (the embedded Dpex worker); starting a new one on %s", what, worker.address)
            try:
                cluster.respawn_worker(index)
            except DpexError as e:
                if cluster.closed:
                    return
                self._error = DpexWorkerError(f"{what} (the embedded Dpex worker), and a new one did not start: "
                                              f"{e}", stage="process", worker=worker.address)
                return

    @property
    def failed(self) -> bool:
        return self._error is not None

    def failure(self) -> BaseException | None:
        """Why the cluster can serve no more (a daemon died for good), or None."""
        return self._error if self._ready.is_set() else None

    def address(self) -> str:
        self._ready.wait()
        if self._error is not None:
            raise DpexError(f"the embedded cluster did not start: {self._error}") from self._error
        assert self._cluster is not None
        return self._cluster.address

    def close(self) -> None:
        """Stops the cluster and waits for it."""
        self._stop.set()
        self._owner.join()


_embedded: dict[tuple[int, str | None, bool], _Shared] = {}
_embedded_lock = threading.Lock()


def embedded(processes: int, auth_token: str | None, start_method: str | None = None) -> Embedded:
    """A lease on this process's embedded cluster of ``processes`` worker
    processes. ``start_method`` (default: multiprocessing's) "fork": its
    worker and their processes are forked from this process, as torch's
    DataLoader forks its workers, if gRPC runs no thread here yet (else, and
    for "spawn" or "forkserver", they are fresh interpreters)."""
    import multiprocessing
    fork = (start_method or multiprocessing.get_start_method()) == "fork"
    key = (processes, auth_token, fork)
    with _embedded_lock:
        shared = _embedded.get(key)
        if shared is None or shared.failed:
            if shared is not None:
                shared.close()
            forkable = fork and can_fork()
            if fork and not forkable:
                _log.info(
                    "gRPC runs threads in this process: the embedded cluster's worker is spawned, not forked "
                    "(its first batch waits for a new interpreter to import torch)")
            shared = _embedded[key] = _Shared(key, forkable)
        shared.users += 1
        if shared.idle is not None:
            shared.idle.cancel()
            shared.idle = None
    return Embedded(shared)


def _release(shared: _Shared) -> None:
    with _embedded_lock:
        shared.users -= 1
        if shared.users > 0 or _embedded.get(shared.key) is not shared:
            return
        # A daemon timer: it never delays exit, where stop_embedded() stops the cluster.
        shared.idle = threading.Timer(EMBEDDED_LINGER_S, _stop_idle, args=(shared,))
        shared.idle.daemon = True
        shared.idle.start()


def _stop_idle(shared: _Shared) -> None:
    with _embedded_lock:
        if shared.users > 0 or _embedded.get(shared.key) is not shared:
            return
        del _embedded[shared.key]
    shared.close()


def stop_embedded() -> None:
    """Stops this process's embedded clusters now (run at interpreter exit);
    a loader made later starts a new one."""
    with _embedded_lock:
        stopping = list(_embedded.values())
        _embedded.clear()
        for shared in stopping:
            if shared.idle is not None:
                shared.idle.cancel()
    for shared in stopping:
        shared.close()


def _stop_at_exit() -> None:
    """At interpreter exit: calls that find a daemon gone fail at once, without retrying or
    saying so (an uncaught error's traceback stays the last thing printed), then the clusters stop."""
    from dpex import rpc
    rpc.exiting()
    stop_embedded()


atexit.register(_stop_at_exit)
