"""A loader's link to the dispatcher: its channel and stub, its job (lane
0's) and the extra lanes it opened, the calls that ride out an outage, and
what it owns (an embedded cluster, the streams to the workers), closed once,
by the loader's close() or when the loader is collected. It holds nothing of
the loader's, so that the loader's finalizer may close it."""
from __future__ import annotations

import math
import secrets
import threading
from typing import Any, Callable

from dpex.client import job as jobs
from dpex.client.lanes import Lane, Lanes
from dpex.client.streams import StreamPool
from dpex.launch.head import announce
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import Outage, call, channel


class Session:
    def __init__(self, address: str | None, embedded_why: str, token: str | None, tls_ca: bytes | None,
                 shared_memory: bool, consumer_index: int, first_contact_s: float, timeout_s: float | None) -> None:
        """``address``: the dispatcher's (None: the embedded cluster's, set
        in ``cluster`` once started); ``first_contact_s``: how long calls
        retry before the dispatcher was first reached; ``timeout_s``: the
        loader's, how long they ride out an outage after (None: for ever)."""
        self.cluster: Any = None
        self.channel: Any = None
        self.stub: Any = None
        self._address, self.embedded_why = address, embedded_why
        self.target = f"dispatcher {address}"
        self.token, self.tls_ca = token, tls_ca
        self._pool_args = (token, tls_ca, shared_memory)
        self.read_frame: Callable[..., Any] | None = None  # pinning's, for frames from other hosts
        self.lanes = Lanes(Lane(0, b"", self.new_streams()))
        self.consumer_index = consumer_index
        self.client_id = secrets.randbits(63) + 1  # this loader's: it holds its consumer of the job
        self.first_contact_s, self.timeout_s = first_contact_s, timeout_s
        self.outage = Outage()  # the dispatcher's: every call to it gives up on one deadline
        self.job_request: dpb.GetOrCreateJobRequest | None = None  # the loader's job, set before connect()
        self.job_id: int | None = None
        self.job_key = b""  # the job's key (dpex.keys), with its id
        self._lock = threading.Lock()
        self._closed = False

    # ---- what it owns -------------------------------------------------------------
    @property
    def address(self) -> str:
        """The dispatcher's HOST:PORT (an embedded cluster's: once it serves)."""
        return self._address if self._address is not None else self.cluster.address

    @property
    def embedded(self) -> bool:
        return self.cluster is not None

    @property
    def streams(self) -> StreamPool:
        """Lane 0's streams, which a loader's epochs use when one is read at a time."""
        return self.lanes.first.streams

    def new_streams(self) -> StreamPool:
        """Streams to the workers for one lane (dpex.client.lanes)."""
        streams = StreamPool(*self._pool_args)
        if self.read_frame is not None:
            streams.read_frame = self.read_frame
        return streams

    def health(self) -> BaseException | None:
        """Why the loader's own (embedded) cluster can serve no more; None: it can."""
        return self.cluster.failure() if self.cluster is not None else None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.lanes.close()
        if self.channel is not None:
            self.channel.close()
        if self.cluster is not None:
            self.cluster.close()

    # ---- calls ----------------------------------------------------------------------
    def call(self, method: Any, request: Any) -> Any:
        return call(method, request, target=self.target, timeout_s=60, retry_for_s=self.retry_for_s(),
                    outage=self.outage)

    def retry_for_s(self) -> float:
        """How long calls to the dispatcher ride out its outage: ``first_contact_s``
        (or ``timeout``, if shorter) until it was first reached (a wrong address fails fast), then as long as
        the loader's ``timeout`` allows (None: for ever), so that a dispatcher
        restarted from its journal finds its trainers still there."""
        if self.job_id is None:
            return self.first_contact_s
        return math.inf if self.timeout_s is None else max(self.timeout_s, self.first_contact_s)

    def connect(self) -> None:
        """Reaches the dispatcher and makes the job, once: at construction, or
        (a dataset instance on the embedded cluster, which starts in the
        background) at the first ``iter()``."""
        if self.stub is not None:
            return
        self._address = self.address
        if self.embedded_why:  # named once it serves: a loader built and dropped unused says nothing
            announce("loading on an embedded local cluster (%s): dispatcher %s", self.embedded_why, self._address)
        self.target = f"dispatcher {self._address}"
        self.channel = channel(self._address, self.token, self.tls_ca)
        self.stub = dgrpc.DispatcherStub(self.channel)
        self.create_job()

    def create_job(self) -> None:
        """Gets or creates the job of lane 0 (again, if the dispatcher collected it)."""
        assert self.job_request is not None
        first = self.lanes.first
        self.job_id, self.job_key = first.job_id, first.job_key = jobs.make(
            self.call, self.stub, self.job_request, named=True)
        first.release = self.releaser(first.job_id, first.job_key)

    def renew_job(self) -> None:
        """The job's definition changed (a dataset instance changed before ``iter()``): a new job
        on lane 0; the old definition's jobs are released once their epochs end (now, if none runs)."""
        self.lanes.renew(Lane(0, b"", self.new_streams()))
        self.create_job()

    def open_lane(self) -> Lane:
        """A lane of its own for an epoch begun while another is read: an unnamed job of the definition."""
        assert self.job_request is not None
        job_id, job_key = jobs.make(self.call, self.stub, self.job_request, named=False)
        return Lane(job_id, job_key, self.new_streams(), self.releaser(job_id, job_key))

    def remake(self, lane: Lane) -> None:
        """Makes a collected lane's job again (the definition is ours: nothing is lost)."""
        assert self.job_request is not None
        if lane is self.lanes.first:
            self.create_job()
        else:
            lane.job_id, lane.job_key = jobs.make(self.call, self.stub, self.job_request, named=False)

    def releaser(self, job_id: int, job_key: bytes, epoch: int | None = None, attempt: int = 0) -> Callable[..., None]:
        """Releases this loader's consumer of ``job_id`` (``epoch``: only that epoch as
        submitted by one iter(), its ``attempt``, left early; else the consumer, at close
        or once a lane is no longer needed)."""
        request = dpb.ReleaseConsumerRequest(job_id=job_id, job_key=job_key, consumer_index=self.consumer_index,
                                             client_id=self.client_id, attempt=attempt)
        if epoch is not None:
            request.epoch = epoch
        return jobs.releaser(self.stub, self.target, request)

    def report(self, address: str, error: str) -> None:
        """Tells the dispatcher a worker's stream broke (a worker found gone is marked lost at once)."""
        jobs.send_and_forget(self.stub.ReportWorker, dpb.ReportWorkerRequest(address=address, error=error))

    def alive_workers(self) -> list[str]:
        status = self.call(self.stub.GetStatus, dpb.GetStatusRequest())
        return [w.address for w in status.workers if w.state == "alive"]
