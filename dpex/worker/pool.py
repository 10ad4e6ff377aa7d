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
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections import OrderedDict
from typing import Any, Callable, Hashable

from dpex import errors, shm, stdlib
from dpex.worker import runtime
from dpex.worker.runtime import Task

log = logging.getLogger("dpex.worker")

__all__ = ["BatchPool", "crash_frame"]

_MAX_LANES = 1024  # consumers' epochs whose cycle position is kept


class BatchPool:
    """N processes. By default they share one queue: a batch goes to the
    first process free. ``in_turn``: each has a queue of its own, as torch's
    DataLoader workers, and the k-th batch of a consumer's epoch goes to
    process k mod N (get_worker_info().id shows it), unless it may pass
    (in_order=False) and that process has ``PREFETCH`` batches to make
    already, as in torch. A crashed process fails its batches, not the
    daemon; its executor (all of them, or itself alone) starts again."""

    PREFETCH = 2  # batches queued at one process before a batch that may pass goes by: torch's prefetch_factor

    def __init__(self, processes: int, worker_address: str = "", *, shared_memory: bool = True,
                 handoff_min_bytes: int = shm.MIN_BYTES, fork: bool = False, in_turn: bool = False,
                 sample_budgets: tuple[int, int] = runtime.SAMPLE_BUDGETS) -> None:
        """With ``shared_memory``, frames of ``handoff_min_bytes`` or more come
        back as /dev/shm files (dpex.shm), else through the pipe.
        ``fork``: fork the first processes (only in a process with no other
        thread yet); ones started after a crash are spawned. The address may
        be given later (:meth:`set_address`)."""
        self._processes = processes
        self._handoff_min_bytes = handoff_min_bytes
        self._sample_budgets = sample_budgets  # the sample cache's memory and disk tiers (dpex.worker.samples)
        # Shared with the children, which name it in their errors: a forked pool starts before the daemon serves.
        self._address = multiprocessing.RawArray("c", 256)
        self.set_address(worker_address)
        # Each child writes its pid and the sample it reads here: what its death (a segfault) reports.
        self._slots = multiprocessing.RawArray("q", [-1] * (2 * processes))
        self._lock = threading.Lock()
        self._closed = False
        self._last_death: tuple[int, int, int] | None = None
        # Executors of `_size` processes each: one of N, or N of one (in turn).
        self._size = 1 if in_turn else processes
        groups = range(0, processes, self._size)
        self._queued = [0] * len(groups)  # batches given to each executor and not finished
        self._count_lock = threading.Lock()  # for _queued and _made: taken in callbacks, under no other lock
        self._made = 0  # frames this daemon made itself (make_frame)
        self._cycle: OrderedDict[Hashable, int] = OrderedDict()  # each lane's next executor (in turn)
        self.handoff_dir = shm.make_dir() if shared_memory else None
        self._executors = [self._executor(first, fork) for first in groups]
        if fork:  # every process forked before any executor runs its thread: the daemon has none yet
            for executor in self._executors:
                stdlib.start_executor_processes(executor)
        # Start every child now, not at the first batch, without waiting for
        # them to import torch: the daemon serves meanwhile, and a batch asked
        # for waits for a child, as it would anyway. Started from this thread:
        # a child dies with the thread that started it (PR_SET_PDEATHSIG).
        for executor in self._executors:
            self._warm(executor)
        # The processes, kept here: a broken executor may have let go of them when death() asks.
        self._children = [stdlib.executor_processes(executor) for executor in self._executors]

    def make_frame(self, parts: list) -> "bytes | shm.Handoff":
        """A frame of ``parts`` made in this daemon, as the batch processes make
        theirs (dpex.shm.frame): a hand-off file when it is large, else bytes."""
        with self._count_lock:
            self._made += 1
            name = f"{os.getpid()}-d{self._made}"
        return shm.frame(self.handoff_dir, self._handoff_min_bytes, name, parts, self._processes)

    def set_address(self, worker_address: str) -> None:
        """The worker's address, as its batch processes report it."""
        self._address.value = worker_address.encode()[:255]

    def _executor(self, first: int, fork: bool) -> ProcessPoolExecutor:
        """The executor of processes ``first``.. ``first + _size - 1`` (their worker ids)."""
        context = multiprocessing.get_context("fork" if fork else "spawn")
        return ProcessPoolExecutor(max_workers=self._size, mp_context=context, initializer=runtime.init_child,
                                   initargs=(self._address, context.Value("i", first), self._processes,
                                             self.handoff_dir, self._handoff_min_bytes, os.getpid(), self._slots,
                                             self._sample_budgets))

    def _warm(self, executor: ProcessPoolExecutor) -> None:
        """Starts each of its processes (a spawned executor starts them as tasks come)."""
        for _ in range(self._size):
            executor.submit(runtime.warm_up)

    def _route(self, lane: Hashable | None, passing: bool) -> int:
        """The executor for the next batch of ``lane`` (None: the least busy);
        ``passing``: it may pass a busy one."""
        if len(self._executors) == 1:
            return 0
        if lane is None:
            return min(range(len(self._executors)), key=self._queued.__getitem__)
        n = len(self._executors)
        start = self._cycle.pop(lane, 0) % n
        index = start if not passing else next(
            (i % n for i in range(start, start + n) if self._queued[i % n] < self.PREFETCH), start)
        self._cycle[lane] = index + 1
        while len(self._cycle) > _MAX_LANES:
            self._cycle.popitem(last=False)
        return index

    def submit(self, fn: Callable[..., Any], *args: Any, lane: Hashable | None = None,
               passing: bool = False) -> Future:
        """Runs ``fn(*args)`` in a child: in turn, the next in ``lane``'s cycle
        (a consumer's epoch; ``passing``: the next not busy), or the least busy."""
        with self._lock:
            if self._closed:
                raise RuntimeError("pool is closed")
            index = self._route(lane, passing)
            try:
                future = self._executors[index].submit(fn, *args)
            except BrokenProcessPool:
                self._last_death = self._death_of(self._children)  # its batch's frame may not be made yet
                log.error("a batch process died; starting %s again", "it" if self._size == 1 else "the pool")
                self._executors[index].shutdown(wait=False, cancel_futures=True)
                self._executors[index] = self._executor(index * self._size, fork=False)  # the daemon runs threads
                self._warm(self._executors[index])
                self._children[index] = stdlib.executor_processes(self._executors[index])
                future = self._executors[index].submit(fn, *args)
            with self._count_lock:
                self._queued[index] += 1
        future.add_done_callback(lambda _, index=index: self._finished(index))
        return future

    def _finished(self, index: int) -> None:
        with self._count_lock:
            self._queued[index] -= 1

    @property
    def closed(self) -> bool:
        """close() was called: its processes are being (or were) stopped."""
        return self._closed

    def death(self) -> tuple[int, int, int] | None:
        """The pid, exit code and the sample it was reading (-1: none known) of
        a process that died by itself (a signal other than the pool's own
        SIGTERM first), when the pool just broke."""
        # No lock: it is called from the executors' callbacks, which close() waits for with the lock held.
        if self._closed:
            return None
        return self._death_of(self._children) or self._last_death

    def _death_of(self, children: list[list]) -> tuple[int, int, int] | None:
        processes = [p for group in children for p in group]
        for p in processes:  # exited, but its status may be being read by the executor's thread: wait for it
            if p.exitcode is None and multiprocessing.connection.wait([p.sentinel], 0):
                p.join(1.0)
                # Reaped by that thread between its waitpid and storing the code, our waitpid found no
                # child (ECHILD) and join returned at once: the code is stored a moment later.
                deadline = time.monotonic() + 1.0
                while p.exitcode is None and time.monotonic() < deadline:
                    time.sleep(0.001)
        dead = [(p.pid, p.exitcode) for p in processes if p.exitcode not in (None, 0)]
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
            for executor in self._executors:
                for process in stdlib.executor_processes(executor):
                    if process.is_alive():
                        process.terminate()
            for executor in self._executors:
                executor.shutdown(wait=True, cancel_futures=True)
            # Their queues and locks are named semaphores in /dev/shm, unlinked
            # when collected: not kept alive by a closed pool still referenced.
            self._executors = []
            shm.remove_dir(self.handoff_dir)


def crash_frame(task: Task, exc: BaseException, worker_address: str, stage: str = "process",
                death: tuple[int, int, int] | None = None) -> bytes:
    """The frame for a batch whose process died (e.g. a segfault or OOM kill;
    ``death``: its pid, exit code and the sample it was reading, if known), or
    (stage "plan") whose indices could not be computed. A death reads as
    torch's DataLoader says it, with the sample."""
    meta = task.key.header()
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
    meta.error.CopyFrom(errors.remote(kind, message, stage=stage, worker=worker_address, sample_index=sample))
    return meta.SerializeToString()
