"""The worker's control-plane agent against a real gRPC server on a loopback
port that plays the dispatcher: it registers, reports what the scheduler
says, hands the scheduler its splits and releases, registers again when
forgotten, fails fast on a wrong address, and deregisters on close."""
import threading
from concurrent import futures

import grpc
import pytest

from dpex.config import WorkerConfig
from dpex.errors import DpexConnectionError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.testing import wait_until
from dpex.worker.agent import DispatcherAgent
from dpex.worker.meter import Meter


class Dispatcher(dgrpc.DispatcherServicer):
    """Answers heartbeats from a script: each answer is taken from ``answers``
    (an empty response once they run out); NOT_FOUND when ``forget`` is set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.registered: list[str] = []
        self.heartbeats: list[dpb.WorkerHeartbeatRequest] = []
        self.answers: list[dpb.WorkerHeartbeatResponse] = []
        self.deregistered: list[str] = []
        self.forget = False
        self.jobs = {7: dpb.JobDef(name="seven", num_consumers=1)}

    def RegisterWorker(self, request, context):
        with self.lock:
            self.registered.append(request.address)
            return dpb.RegisterWorkerResponse(worker_id=f"w{len(self.registered)}")

    def WorkerHeartbeat(self, request, context):
        with self.lock:
            self.heartbeats.append(request)
            if self.forget:
                self.forget = False
                context.abort(grpc.StatusCode.NOT_FOUND, f"unknown worker {request.worker_id}")
            return self.answers.pop(0) if self.answers else dpb.WorkerHeartbeatResponse(pause=True)

    def GetJob(self, request, context):
        return dpb.GetJobResponse(job=self.jobs[request.job_id])

    def DeregisterWorker(self, request, context):
        self.deregistered.append(request.worker_id)
        return dpb.DeregisterWorkerResponse()


class Scheduler:
    """What the agent asks of the worker's scheduler, recorded."""

    def __init__(self) -> None:
        self.meter = Meter(2)
        self.held: list[int] = []
        self.added: list[dpb.Split] = []
        self.released: list[int] = []
        self.released_all = 0
        self.on_capacity = None

    def free_capacity(self, max_held_splits, record=True):
        return max_held_splits - len(self.held), [(7, 1)]

    def held_split_ids(self):
        return list(self.held)

    def load(self):
        return self.meter.load(buffer_batches=3, running_batches=1)

    def add_split(self, split):
        self.added.append(split)
        self.held.append(split.split_id)

    def release(self, split_ids):
        self.released.extend(split_ids)
        self.held = [s for s in self.held if s not in split_ids]

    def release_all(self):
        self.released_all += 1
        self.held = []


@pytest.fixture
def dispatcher():
    servicer = Dispatcher()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    dgrpc.add_DispatcherServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def agent_for(address: str, scheduler: Scheduler, tmp_path) -> DispatcherAgent:
    config = WorkerConfig(dispatcher=address, heartbeat_interval_s=0.2, connect_timeout_s=1.0, max_held_splits=3)
    return DispatcherAgent(config, "127.0.0.1:5555", scheduler, str(tmp_path))


def test_heartbeats_report_the_scheduler_and_bring_splits_and_releases(dispatcher, tmp_path):
    servicer, address = dispatcher
    split = dpb.Split(split_id=11, job_id=7, consumer_index=1, num_batches=4)
    servicer.answers = [dpb.WorkerHeartbeatResponse(splits=[split]),
                        dpb.WorkerHeartbeatResponse(release_split_ids=[11])]
    scheduler = Scheduler()
    agent = agent_for(address, scheduler, tmp_path)
    agent.start()
    try:
        assert agent.worker_id == "w1" and servicer.registered == ["127.0.0.1:5555"]
        wait_until(lambda: scheduler.released == [11], 10, "the split taken, then released")
        assert scheduler.added == [split]
        assert dpb.JobDef.FromString(open(agent.job_path(7), "rb").read()).name == "seven"  # fetched for its split
        wait_until(lambda: len(servicer.heartbeats) >= 3, 10, "a heartbeat after the release")
        first, second = servicer.heartbeats[:2]
        assert (first.worker_id, first.want_splits, list(first.held_split_ids)) == ("w1", 3, [])
        assert (second.want_splits, list(second.held_split_ids)) == (2, [11])
        assert [(c.job_id, c.consumer_index) for c in first.saturated] == [(7, 1)]
        assert (first.load.buffer_batches, first.load.running_batches) == (3, 1)
    finally:
        agent.close(deregister=True)
    assert servicer.deregistered == ["w1"]


def test_a_worker_the_dispatcher_forgot_releases_its_splits_and_registers_again(dispatcher, tmp_path):
    servicer, address = dispatcher
    scheduler = Scheduler()
    scheduler.held = [4, 5]
    agent = agent_for(address, scheduler, tmp_path)
    agent.start()
    try:
        servicer.forget = True  # e.g. it restarted without a journal
        wait_until(lambda: agent.worker_id == "w2", 10, "registration again")
        assert scheduler.released_all == 1 and scheduler.held == []
        wait_until(lambda: any(h.worker_id == "w2" for h in servicer.heartbeats), 10, "heartbeats as w2")
    finally:
        agent.close()
    assert servicer.deregistered == []  # close() without deregister: the heartbeat timeout does it


def test_a_wrong_dispatcher_address_fails_at_start_and_says_what_to_check(tmp_path):
    with socket_that_refuses() as address:
        agent = agent_for(address, Scheduler(), tmp_path)
        with pytest.raises(DpexConnectionError, match="Check that the dispatcher runs.*--connect-timeout"):
            agent.start()
        agent.close()


def socket_that_refuses():
    """An address on loopback where nothing listens."""
    import contextlib
    import socket

    @contextlib.contextmanager
    def refused():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
            yield f"127.0.0.1:{s.getsockname()[1]}"
    return refused()
