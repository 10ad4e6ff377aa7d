"""LocalCluster: a dispatcher and workers as local processes on loopback ports."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from typing import Any, Callable

from dpex import finalizers
from dpex.config import DispatcherConfig, WorkerConfig
from dpex.errors import DpexConfigError, DpexError
from dpex.auth import TOKEN_ENV
from dpex.daemon import Daemon, await_ready, spawn, stop_process
from dpex.procutil import PARENT_ENV, remove_dead_temp_dirs, temp_dir
from dpex import shm
from dpex.launch import warmstart

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
    """Starts ``dpex-dispatcher`` and ``num_workers`` ``dpex-worker`` processes on this machine.

    The cluster stops on :meth:`close`, on garbage collection, at interpreter exit, and (Linux) when the
    starting process dies. The keyword arguments are the daemons' flags (``dpex-dispatcher --help``).

    Args:
        num_workers: workers to start.
        processes: batch processes each worker runs.
        host: the address the daemons listen on and advertise.
        heartbeat_interval_s: the workers' heartbeat interval.
        heartbeat_timeout_s: heartbeats missed this long: a worker is lost.
        split_size_batches: batches a split holds.
        buffer_batches: each consumer's batches a worker makes ahead; None: the worker's default.
        work_dir: the dispatcher's journal directory; None: state in memory only.
        consumer_timeout_s: a silent trainer is released after this long.
        auth_token: the cluster's token, in the daemons' environment; None: no authentication.
        tls: (certificate, key, CA) files: both daemons serve TLS, workers verify the dispatcher.
        metrics: give every daemon a Prometheus endpoint (``Daemon.metrics_url``).
        dispatcher_flags: more command-line flags for the dispatcher.
        worker_flags: more command-line flags for each worker.
        start_timeout_s: how long to wait for each daemon to serve.
        env: more environment variables for the daemons.
        drain_timeout_s: how long a stopped worker answers the calls in flight.
        log_dir: where the daemons' logs go; None: a new temporary directory, removed on close.
        own_session: start the daemons in a session of their own, out of reach of a Ctrl-C (SIGINT) to
            the starter's process group: they stop with the starter, which may ignore or handle SIGINT.
        warm_start: (Linux) fork the daemons from one process per starter that has imported torch, gRPC
            and Dpex once (:mod:`dpex.launch.warmstart`), rather than start each as a new interpreter: a
            worker serves in a fraction of a second, not after a second of imports. For tests and
            notebooks that start many clusters; what modules read from the environment when imported
            (torch's threads, gRPC) is then the first cluster's.

    Raises:
        DpexConfigError: fewer than 0 workers or 1 process.
        DpexError: a daemon that did not start, with its log's tail.
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
                 own_session: bool = False, warm_start: bool = False) -> None:
        if num_workers < 0 or processes < 1:
            raise DpexConfigError("num_workers must be >= 0 and processes >= 1")
        self.host = host
        self._processes = processes
        self._hb = (heartbeat_interval_s, heartbeat_timeout_s)
        self._buffer_batches = buffer_batches
        self._drain_timeout_s = drain_timeout_s
        self._start_timeout_s = start_timeout_s
        self._own_session = own_session
        self._warm_start = warm_start and warmstart.available()
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
        self._finalizer = finalizers.finalize(self, LocalCluster._close_all, self._procs, self.log_dir)
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
        starter = self._starter()  # before the lock: the first one imports torch
        with self._procs.lock:
            if self._procs.closed:
                raise DpexError(f"the cluster is stopping: no {name} starts")
            self._count += 1
            stem = os.path.join(self.log_dir, f"{name}-{self._count}")
            ready, log_path = stem + ".ready", stem + ".log"
            env = {**self._env, **(env or {})}
            process = None
            if starter is not None:
                try:
                    process = starter.start(["-m", *args, "--ready-file", ready], env, log_path,
                                            session=self._own_session)
                except OSError as e:  # it died: a new interpreter does the same
                    _log.warning("starting the %s as a new interpreter: %s", name, e)
            if process is None:
                process = spawn(args, ready, log_path, env, start_new_session=self._own_session)
            self._procs.starting.add(process)
        return process, ready, log_path

    def _starter(self) -> warmstart.WarmStarter | None:
        if not self._warm_start:
            return None
        try:
            return warmstart.starter()
        except OSError as e:  # it could not start: each daemon is a new interpreter, as without warm_start
            _log.warning("no warm start: %s", e)
            return None

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
        """Starts more workers, in parallel, and waits until they serve.

        Args:
            n: how many.
            env: more environment variables for them.
        Returns:
            The new workers."""
        started = [self._spawn("worker", self._worker_args(), env) for _ in range(n)]
        return [self._serving("worker", spawned, self._procs.workers.append) for spawned in started]

    def adopt_worker(self, process: Any, ready: str, log_path: str) -> Daemon:
        """Waits for a worker started elsewhere to serve, and stops it with the cluster.

        An embedded worker forked from the trainer is one.

        Args:
            process: the worker's process (``wait``, ``send_signal``, ``poll``).
            ready: the file it writes its address to once it serves.
            log_path: its log.
        Returns:
            The worker."""
        with self._procs.lock:
            self._procs.starting.add(process)
        return self._serving("worker", (process, ready, log_path), self._procs.workers.append)

    def kill_worker(self, index: int, sig: int = signal.SIGKILL) -> Daemon:
        """Sends a signal to a worker and waits for it to exit.

        Args:
            index: the worker's place in :attr:`workers`.
            sig: the signal (SIGTERM drains it).
        Returns:
            The worker."""
        daemon = self.workers[index]
        daemon.process.send_signal(sig)
        daemon.process.wait()
        return daemon

    def restart_worker(self, index: int, sig: int = signal.SIGKILL) -> Daemon:
        """Kills a worker and starts a new one on the same address.

        Args:
            index: the worker's place in :attr:`workers`.
            sig: the signal that stops it.
        Returns:
            The new worker."""
        self.kill_worker(index, sig)
        return self.respawn_worker(index)

    def respawn_worker(self, index: int) -> Daemon:
        """Starts a new worker on the address of a worker that has exited.

        Registered there, it replaces the old one in the dispatcher at once (taking its splits), and
        trainers reach it where they were.

        Args:
            index: the exited worker's place in :attr:`workers`.
        Returns:
            The new worker."""
        port = self.workers[index].address.rsplit(":", 1)[1]
        return self._start("worker", self._worker_args(port),
                           lambda daemon: self._procs.workers.__setitem__(index, daemon))

    def restart_dispatcher(self, sig: int = signal.SIGKILL) -> Daemon:
        """Stops the dispatcher and starts it again on its port and work dir; workers and trainers reconnect.

        Args:
            sig: the signal that stops it (SIGTERM: as Kubernetes stops it).
        Returns:
            The new dispatcher."""
        self.stop_dispatcher(sig)
        return self.start_dispatcher()

    def stop_dispatcher(self, sig: int = signal.SIGKILL) -> None:
        """Stops the dispatcher; :meth:`start_dispatcher` brings it back.

        Args:
            sig: the signal that stops it."""
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
