"""The worker's process pool (daemon side): N processes that run
dpex.worker.runtime, so the daemon only forwards the bytes they return.
Spawned, not forked, once the daemon runs gRPC threads; a pool made before
any thread (an embedded worker forked from its trainer, which has imported
torch already) forks its first processes, as torch's DataLoader does."""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from dpex import shm
from dpex.worker import runtime
from dpex.worker.runtime import Task

log = logging.getLogger("dpex.worker")

__all__ = ["BatchPool", "crash_frame"]


class BatchPool:
    """A pool of N processes; a crashed child fails its batch, not the daemon."""

    def __init__(self, processes: int, worker_address: str = "", *, shared_memory: bool = True,
                 handoff_min_bytes: int = shm.MIN_BYTES, fork: bool = False) -> None:
        """With ``shared_memory``, frames of ``handoff_min_bytes`` or more come
        back as /dev/shm files (dpex.shm), else through the pipe.
        ``fork``: fork the first processes (only in a process with no other
        thread yet); ones started after a crash are spawned. The address may
        be given later (:meth:`set_address`)."""
        self._processes = processes
        self._handoff_min_bytes = handoff_min_bytes
        # Shared with the children, which name it in their errors: a forked pool starts before the daemon serves.
        self._address = multiprocessing.RawArray("c", 256)
        self.set_address(worker_address)
        self._fork = fork
        self._lock = threading.Lock()
        self._closed = False
        self._last_death: tuple[int, int, int] | None = None
        self.handoff_dir = shm.make_dir() if shared_memory else None
        self._executor = self._start()

    def set_address(self, worker_address: str) -> None:
        """The worker's address, as its batch processes report it."""
        self._address.value = worker_address.encode()[:255]

    def _start(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("fork" if self._fork else "spawn")
        self._fork = False  # the daemon runs threads from now on
        # Each child writes its pid and the sample it reads here: what its death (a segfault) reports.
        self._slots = context.Array("q", [-1] * (2 * self._processes), lock=False)
        executor = ProcessPoolExecutor(max_workers=self._processes, mp_context=context,
                                       initializer=runtime.init_child,
                                       initargs=(self._address, context.Value("i", 0), self._processes,
                                                 self.handoff_dir, self._handoff_min_bytes, os.getpid(),
                                                 self._slots))
        # Start every child now, not at the first batch, without waiting for
        # them to import torch: the daemon serves meanwhile, and a batch asked
        # for waits for a child, as it would anyway. Started from this thread:
        # a child dies with the thread that started it (PR_SET_PDEATHSIG).
        for _ in range(self._processes):
            executor.submit(runtime.warm_up)
        # The processes, kept here: a broken executor may have let go of them when death() asks.
        self._children = list(getattr(executor, "_processes", {}).values())
        return executor

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is closed")
            try:
                return self._executor.submit(fn, *args)
            except BrokenProcessPool:
                self._last_death = self._death_of(self._children)  # its batch's frame may not be made yet
                log.error("a batch process died; restarting the pool")
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._start()
                return self._executor.submit(fn, *args)

    @property
    def closed(self) -> bool:
        """close() was called: its processes are being (or were) stopped."""
        return self._closed

    def death(self) -> tuple[int, int, int] | None:
        """The pid, exit code and the sample it was reading (-1: none known) of
        a process that died by itself (a signal other than the pool's own
        SIGTERM first), when the pool just broke."""
        # No lock: it is called from the executor's callbacks, which close() waits for with the lock held.
        if self._closed or self._executor is None:
            return None
        return self._death_of(self._children) or self._last_death

    def _death_of(self, children: list) -> tuple[int, int, int] | None:
        for p in children:  # exited, but its status may be being read by the executor's thread: wait for it
            if p.exitcode is None and multiprocessing.connection.wait([p.sentinel], 0):
                p.join(1.0)
        dead = [(p.pid, p.exitcode) for p in children if p.exitcode not in (None, 0)]
        dead.sort(key=lambda d: d[1] == -signal.SIGTERM)
        if not dead:
            return None
        pid, code = dead[0]
        slots = list(self._slots)
        sample = next((slots[i + 1] for i in range(0, len(slots), 2) if slots[i] == pid), -1)
        return pid, code, sample

    def close(self) -> None:
        """Kills the processes (a batch still running is abandoned: the
        dispatcher has handed its split to another worker) and waits for them."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for process in list(getattr(self._executor, "_processes", {}).values()):
                if process.is_alive():
                    process.terminate()
            self._executor.shutdown(wait=True, cancel_futures=True)
            # Its queues and locks are named semaphores in /dev/shm, unlinked
            # when collected: not kept alive by a closed pool still referenced.
            self._executor = None  # type: ignore[assignment]
            shm.remove_dir(self.handoff_dir)


def crash_frame(task: Task, exc: BaseException, worker_address: str, stage: str = "process",
                death: tuple[int, int, int] | None = None) -> bytes:
    """The frame for a batch whose process died (e.g. a segfault or OOM kill;
    ``death``: its pid, exit code and the sample it was reading, if known), or
    (stage "plan") whose indices could not be computed. A death reads as
    torch's DataLoader says it, with the sample."""
    from dpex.proto import worker_pb2 as wpb
    meta = wpb.Batch(job_id=task.job_id, consumer_index=task.consumer_index,
                     epoch=task.epoch, seq=task.seq)
    kind = type(exc)
    if stage == "process":
        kind = RuntimeError
        if death is None:
            message = f"DataLoader worker exited unexpectedly ({exc})"
        elif death[1] < 0:
            message = f"DataLoader worker (pid {death[0]}) is killed by signal: {signal.strsignal(-death[1])}."
        else:
            message = f"DataLoader worker (pid(s) {death[0]}) exited unexpectedly with exit code {death[1]}."
        message += " It was making this batch"
        if death is not None and death[2] >= 0:
            message += f", reading dataset[{death[2]}]"
    else:
        message = str(exc)
    sample = death[2] if death is not None else -1
    meta.error.CopyFrom(wpb.RemoteError(type=kind.__name__, type_ref=f"{kind.__module__}:{kind.__qualname__}",
                                        message=message, traceback="", sample_index=sample,
                                        worker=worker_address, stage=stage))
    return meta.SerializeToString()
