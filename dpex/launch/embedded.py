"""The embedded cluster of a trainer process: a LocalCluster that loaders
with no dispatcher address share, started in the background, watched
(a worker that dies is started again), stopped when idle and at exit."""
from __future__ import annotations

import logging
import os
import shutil
import threading

from dpex import finalizers
from dpex.daemon import can_fork, exit_reason, stop_process
from dpex.errors import DpexConfigError, DpexError, DpexWorkerError
from dpex.launch import warmstart
from dpex.launch.forked import ForkedProcess, fork_worker
from dpex.launch.local import LocalCluster
from dpex.procutil import temp_dir

_log = logging.getLogger("dpex.launch")

EMBEDDED_LINGER_S = 10.0  # an idle embedded cluster waits this long for the next loader, then stops
SUPERVISE_S = 0.25        # how often the embedded cluster's owner looks for a daemon that died
MAX_RESPAWNS = 3          # embedded workers started again after one died; one more death is an error


class Lease:
    """A lease on this process's embedded cluster (one dispatcher, one worker of
    ``processes`` processes). The first loader to need one starts it in the
    background, so that constructing a loader does not wait for daemons; the
    loaders of a script (train and validation, a new loader each epoch) share
    it; it stops ``EMBEDDED_LINGER_S`` after the last lease is closed, and at
    interpreter exit."""

    def __init__(self, cluster: "_Cluster") -> None:
        self._cluster: _Cluster | None = cluster

    @property
    def address(self) -> str:
        """The dispatcher's address, once it serves (waits for the start)."""
        if self._cluster is None:
            raise DpexConfigError("this embedded cluster lease is closed")
        return self._cluster.address()

    def failure(self) -> BaseException | None:
        """Why the cluster can serve no more (its dispatcher died, or its worker
        died more often than it is started again), or None."""
        return self._cluster.failure() if self._cluster is not None else None

    def close(self) -> None:
        """Gives the lease back; safe to call more than once."""
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            _release(cluster)


class _Cluster:
    """One embedded cluster and the thread that owns it: the daemons are its
    children (PR_SET_PDEATHSIG fires when the thread that started a process
    ends), so it lives until the cluster is stopped. With ``fork``, its
    worker is forked from this process at once, in the caller's thread (see
    dpex.launch.forked). The dispatcher (and a worker not forked here) is a new
    interpreter, or a fork of this process's warm starter if it has one already
    (a ``LocalCluster(warm_start=True)`` started it): it then serves at once."""

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
                                             own_session=True, worker_flags=("--in-turn",),
                                             warm_start=warmstart.running())
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
        # A daemon found gone while the cluster stops did not die: asked after seeing it gone (at
        # exit the cluster's finalizer may stop the daemons before stop_embedded() stops this thread).
        stopping = lambda: cluster.closed or self._stop.is_set()  # noqa: E731
        dispatcher = cluster.dispatcher.process
        if dispatcher.poll() is not None:
            if not stopping():
                self._error = DpexWorkerError(
                    f"the embedded Dpex dispatcher {exit_reason(dispatcher.pid, dispatcher.returncode)} "
                    f"Its log:\n{cluster.dispatcher.log_tail()}", stage="process")
            return
        for index, worker in enumerate(list(cluster.workers)):
            code = worker.process.poll()
            if code is None:
                continue
            if stopping():
                return
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


_embedded: dict[tuple[int, str | None, bool], _Cluster] = {}
_embedded_lock = threading.Lock()


def embedded(processes: int, auth_token: str | None, start_method: str | None = None) -> Lease:
    """A lease on this process's embedded cluster of ``processes`` worker
    processes. ``start_method`` (default: multiprocessing's) "fork": its
    worker and their processes are forked from this process, as torch's
    DataLoader forks its workers, if gRPC runs no thread here yet (else, and
    for "spawn" or "forkserver", they are fresh interpreters)."""
    import multiprocessing
    fork = (start_method or multiprocessing.get_start_method()) == "fork"
    key = (processes, auth_token, fork)
    with _embedded_lock:
        cluster = _embedded.get(key)
        if cluster is None or cluster.failed:
            if cluster is not None:
                cluster.close()
            forkable = fork and can_fork()
            if fork and not forkable:
                _log.info(
                    "gRPC runs threads in this process: the embedded cluster's worker is spawned, not forked "
                    "(its first batch waits for a new interpreter to import torch)")
            cluster = _embedded[key] = _Cluster(key, forkable)
        cluster.users += 1
        if cluster.idle is not None:
            cluster.idle.cancel()
            cluster.idle = None
    return Lease(cluster)


def _release(cluster: _Cluster) -> None:
    with _embedded_lock:
        cluster.users -= 1
        if cluster.users > 0 or _embedded.get(cluster.key) is not cluster:
            return
        # A daemon timer: it never delays exit, where stop_embedded() stops the cluster.
        cluster.idle = threading.Timer(EMBEDDED_LINGER_S, _stop_idle, args=(cluster,))
        cluster.idle.daemon = True
        cluster.idle.start()


def _stop_idle(cluster: _Cluster) -> None:
    with _embedded_lock:
        if cluster.users > 0 or _embedded.get(cluster.key) is not cluster:
            return
        del _embedded[cluster.key]
    cluster.close()


def stop_embedded() -> None:
    """Stops this process's embedded clusters now (run at interpreter exit);
    a loader made later starts a new one."""
    with _embedded_lock:
        stopping = list(_embedded.values())
        _embedded.clear()
        for cluster in stopping:
            if cluster.idle is not None:
                cluster.idle.cancel()
    for cluster in stopping:
        cluster.close()


def _stop_at_exit() -> None:
    """At interpreter exit: calls that find a daemon gone fail at once, without retrying or
    saying so (an uncaught error's traceback stays the last thing printed), then the clusters stop."""
    from dpex import rpc
    rpc.exiting()
    stop_embedded()


finalizers.register_at_exit(_stop_at_exit)
