"""A DispatcherCore in process, and the calls the dispatcher's unit tests make of it."""
import asyncio

import pytest

from dpex import keys
from dpex.config import DispatcherConfig
from dpex.dispatcher.core import DispatcherCore
from dpex.proto import dispatcher_pb2 as dpb

LOCAL = "ipv4:127.0.0.1:40000"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_core():
    cores = []

    def make_core(clock=None, **kw):
        kw = {"port": 0, "heartbeat_interval_s": 0.05, "heartbeat_timeout_s": 5.0, "split_size_batches": 2, **kw}
        core = DispatcherCore(DispatcherConfig(**kw), **({"clock": clock} if clock else {}))
        cores.append(core)
        return core
    yield make_core
    for core in cores:
        core.close()


def job_key(core, job_id):
    """The key GetOrCreateJob hands the job's loaders (dpex.keys)."""
    return keys.job_key(core.keys.secret, job_id)


def worker_key(core, worker_id):
    """The key RegisterWorker hands the worker."""
    return keys.worker_key(core.keys.secret, worker_id)


def job(core, name="", consumers=1):
    return core.get_or_create_job(dpb.GetOrCreateJobRequest(job=dpb.JobDef(
        name=name, dataset=b"spec", num_consumers=consumers, batch_size=4)), LOCAL).job_id


def plan(core, job_id, num_batches, consumer=0, epoch=0, client=1, attempt=0):
    request = dpb.SubmitPlanRequest(job_id=job_id, job_key=job_key(core, job_id), consumer_index=consumer, epoch=epoch, base_seed=3,
                                    client_id=client, attempt=attempt, batches=[dpb.IndexBatch(indices=[i]) for i in range(num_batches)])
    return core.submit_plan(request, LOCAL)


def heartbeat(core, worker_id, want=4, held=()):
    return asyncio.run(core.worker_heartbeat(dpb.WorkerHeartbeatRequest(
        worker_id=worker_id, worker_key=worker_key(core, worker_id), want_splits=want, held_split_ids=held), LOCAL))


