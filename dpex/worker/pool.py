"""The worker's process pool (daemon side): N spawned processes that run
dpex.worker.runtime, so the daemon only forwards the bytes they return.
Spawned, not forked: the daemon runs gRPC threads."""
from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

from dpex.worker import handoff, runtime
from dpex.worker.runtime import Task

log = logging.getLogger("dpex.worker")

__all__ = ["BatchPool", "crash_frame"]


class BatchPool:
    """A pool of N processes; a crashed child fails its batch, not the daemon."""

    def __init__(self, processes: int, worker_address: str, *, shared_memory: bool = True,
                 handoff_min_bytes: int = handoff.MIN_BYTES) -> None:
        """With ``shared_memory``, frames of ``handoff_min_bytes`` or more come
        back as /dev/shm files (dpex.worker.handoff), else through the pipe."""
        self._processes = processes
        self._handoff_min_bytes = handoff_min_bytes
        self._address = worker_address
        self._lock = threading.Lock()
        self._closed = False
        self.handoff_dir = handoff.make_dir() if shared_memory else None
        self._executor = self._start()

    def _start(self) -> ProcessPoolExecutor:
        context = multiprocessing.get_context("spawn")
        executor = ProcessPoolExecutor(max_workers=self._processes, mp_context=context,
                                       initializer=runtime.init_child,
                                       initargs=(self._address, context.Value("i", 0), self._processes,
                                                 self.handoff_dir, self._handoff_min_bytes, os.getpid()))
        # Start every child now, not at the first batch, without waiting for
        # them to import torch: the daemon serves meanwhile, and a batch asked
        # for waits for a child, as it would anyway. Started from this thread:
        # a child dies with the thread that started it (PR_SET_PDEATHSIG).
        for _ in range(self._processes):
            executor.submit(runtime.warm_up)
        return executor

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is closed")
            try:
                return self._executor.submit(fn, *args)
            except BrokenProcessPool:
                log.error("a batch process died; restarting the pool")
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._start()
                return self._executor.submit(fn, *args)

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
            handoff.remove_dir(self.handoff_dir)


def crash_frame(task: Task, exc: BaseException, worker_address: str, stage: str = "process") -> bytes:
    """The frame for a batch whose process died (e.g. a segfault or OOM kill),
    or (stage "plan") whose indices could not be computed."""
    from dpex.proto import worker_pb2 as wpb
    meta = wpb.Batch(job_id=task.job_id, consumer_index=task.consumer_index,
                     epoch=task.epoch, seq=task.seq)
    message = f"the batch process died while producing this batch: {exc}" if stage == "process" else str(exc)
    meta.error.CopyFrom(wpb.RemoteError(type=type(exc).__name__, message=message, traceback="",
                                        sample_index=-1, worker=worker_address, stage=stage))
    return meta.SerializeToString()
