"""What the worker side's unit tests share: a job file as a worker keeps one,
a batch pool of one process (module-scoped: the tests of a module share it),
and a pool run by hand (ManualPool)."""
import threading
from concurrent.futures import Future
from typing import Any, Callable

import cloudpickle
import pytest
import torch

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.wire import build_frame, encode
from dpex.wire.batchkey import Key
from dpex.worker.pool import BatchPool


def job_file(tmp_path: Any, dataset: str, name: str = "job.pb", worker_init_fn: Callable | None = None,
             collate_fn: Callable | None = None, batch_size: int = 0, **kwargs: Any) -> str:
    """A job-<id>.pb of ``dpex.testing.datasets:<dataset>(**kwargs)``, one consumer; its path."""
    path = tmp_path / name
    job = dpb.JobDef(dataset=cloudpickle.dumps(dpex.DatasetSpec(f"dpex.testing.datasets:{dataset}", **kwargs)),
                     num_consumers=1, batch_size=batch_size)
    if worker_init_fn is not None:
        job.worker_init_fn = cloudpickle.dumps(worker_init_fn)
    if collate_fn is not None:
        job.collate = cloudpickle.dumps(collate_fn)
    path.write_bytes(job.SerializeToString())
    return str(path)


@pytest.fixture(scope="module")
def pool():
    p = BatchPool(1, "test-worker")
    yield p
    p.close()


class ManualPool:
    """A batch pool the test runs by hand, in place of dpex.worker.pool.BatchPool
    (its interface as the scheduler and the runners use it): a batch submitted
    is made when the test says (:meth:`finish`), as ``{"y": its indices}``, the
    frame a Squares dataset's batch would be. No process: what the scheduler
    starts, and when, is the test's to see and to drive."""

    closed = False

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: dict[Key, tuple[Future, Any]] = {}
        self.lanes: list[Any] = []  # each submitted batch's lane, in order
        self.started: list[int] = []  # each submitted batch's seq, in order

    def submit(self, fn: Callable[..., Any], task: Any, lane: Any = None, passing: bool = False) -> Future:
        future: Future = Future()
        with self._cond:
            self._running[task.key] = (future, task)
            self.lanes.append(lane)
            self.started.append(task.key.seq)
            self._cond.notify_all()
        return future

    def running(self, job_id: int | None = None) -> list[int]:
        """The seqs being made (of ``job_id``'s batches, if given), in order."""
        with self._cond:
            return sorted(k.seq for k in self._running if job_id is None or k.job_id == job_id)

    def wait_running(self, n: int) -> list[int]:
        """The seqs being made once there are ``n`` (as the scheduler's thread starts them)."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._running) >= n, timeout=30):
                raise AssertionError(f"{n} batches never ran: {sorted(self._running)}")
            return sorted(k.seq for k in self._running)

    def finish(self, *seqs: int, job_id: int | None = None, error: BaseException | None = None) -> None:
        """Makes the batches ``seqs`` being made (all of them if none given): their frames, or ``error``."""
        with self._cond:
            keys = [k for k in self._running if (not seqs or k.seq in seqs) and job_id in (None, k.job_id)]
            if seqs and len(keys) != len(seqs):
                raise AssertionError(f"not all of {seqs} are being made: {sorted(self._running)}")
            done = [self._running.pop(k) for k in keys]
        for future, task in done:  # outside the lock: the scheduler's callbacks run here
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(build_frame(task.key.header(), encode({"y": torch.tensor(task.indices)})))

    def make_frame(self, parts: list) -> bytes:
        return b"".join(bytes(p) for p in parts)

    def death(self) -> None:
        return None

    def close(self) -> None:
        self.closed = True
