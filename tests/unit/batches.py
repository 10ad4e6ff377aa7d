"""What the worker side's unit tests share: a job file as a worker keeps one,
and a batch pool of one process (module-scoped: the tests of a module share it)."""
from typing import Any, Callable

import cloudpickle
import pytest

import dpex
from dpex.proto import dispatcher_pb2 as dpb
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
