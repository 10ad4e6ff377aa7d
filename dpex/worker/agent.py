"""The worker's side of the control plane: register, heartbeat, take splits.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py."""
from __future__ import annotations

import functools
import logging
import math
import os
import re
import tempfile
import threading
import time
from typing import Any, Callable

from dpex import keys
from dpex.auth import Tokens, load_ca
from dpex.config import WorkerConfig
from dpex.errors import DpexAuthError, DpexCancelledError, DpexConnectionError, DpexError, DpexNotFoundError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import Outage, call, channel
from dpex.worker.scheduler import Scheduler
from dpex.log import fields, set_context
from dpex.plan.spec import share_digest
from dpex.version import versions

log = logging.getLogger("dpex.worker")


_JOB_FILE = re.compile(r"job-(\d+)\.pb")


class DispatcherAgent:
    def __init__(self, config: WorkerConfig, address: str, scheduler: Scheduler, job_dir: str,
                 tokens: Tokens | None = None, on_refused: Callable[[bool], None] | None = None) -> None:
        """``tokens``: what calls carry (default: ``config.auth_token``); ``on_refused(True)`` when the
        dispatcher refuses them, ``on_refused(False)`` when it takes them again."""
        self._config = config
        self._address = address
        self._scheduler = scheduler
        self._job_dir = job_dir
        self._jobs: dict[int, dpb.JobDef] = {}  # by job: its definition, without its code
        self._digests: dict[int, bytes | None] = {}  # by job: what it shares (dpex.plan.spec.share_digest)
        self._channel = channel(config.dispatcher, tokens if tokens is not None else config.auth_token,
                                load_ca(config.tls_ca_file))
        self._on_refused = on_refused or (lambda refused: None)
        self._refused = False
        self._stub = dgrpc.DispatcherStub(self._channel)
        self._stop = threading.Event()
        self._outage = Outage()  # the dispatcher's, shared by every call to it
        self._lock = threading.Lock()
        self._poll: Any = None  # the heartbeat in flight, to cut short when room frees
        self._asked: tuple[int, list] | None = None  # what it asked for: (splits wanted, saturated)
        self._nudge = threading.Event()  # room freed: a pause between heartbeats ends
        scheduler.on_capacity = self._room_freed
        self.worker_id = ""
        self._worker_key = self._keys_secret = b""  # from the registration (dpex.keys)
        self.registered = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpex-agent")

    def start(self) -> None:
        try:
            self._register()  # fail fast at start: a wrong --dispatcher is an error, not a hang
        except DpexConnectionError as e:
            raise DpexConnectionError(
                f"{e}. Check that the dispatcher runs and that --dispatcher / DPEX_DISPATCHER reaches it from "
                "this host (in Kubernetes: the dispatcher Service's name, in this pod's namespace or as "
                "NAME.NAMESPACE, and its port); give it longer with --connect-timeout") from None
        self._thread.start()

    def job_path(self, job_id: int) -> str:
        return os.path.join(self._job_dir, f"job-{job_id}.pb")

    def _kept_jobs(self) -> list[int]:
        """The jobs whose definitions are on disk here (this daemon's, or an earlier one's in its job dir)."""
        try:
            names = os.listdir(self._job_dir)
        except OSError:
            return []
        return [int(m.group(1)) for m in map(_JOB_FILE.fullmatch, names) if m]

    def _forget_job(self, job_id: int) -> None:
        """The dispatcher collected the job: its definition goes (a long-lived
        worker kept every job's file, 2 MB each for a dataset shipped by value)."""
        self._jobs.pop(job_id, None)
        self._digests.pop(job_id, None)
        try:
            os.unlink(self.job_path(job_id))
        except FileNotFoundError:
            pass
        log.debug("job definition removed: the dispatcher collected the job", extra=fields(job_id=job_id))

    def _rpc(self, method, request, timeout_s: float, track=None, retry_for_s: float | None = None):
        """A call to the dispatcher; its outages are one (logged when they start, every 30 s and when
        they end), retried for ``retry_for_s`` (default: --connect-timeout)."""
        return call(method, request, target=f"dispatcher {self._config.dispatcher}",
                    timeout_s=timeout_s, outage=self._outage, stop=self._stop.is_set, track=track,
                    retry_for_s=self._config.connect_timeout_s if retry_for_s is None else retry_for_s)

    def _track_poll(self, asked: tuple[int, list], future: Any) -> None:
        with self._lock:
            self._poll, self._asked = future, (asked if future is not None else None)
        if future is not None and (self._stop.is_set() or self._more_room(asked)):
            self._cut()  # closing, or room came between asking and this call starting

    def _more_room(self, asked: tuple[int, list]) -> bool:
        want, saturated = self._scheduler.free_capacity(self._config.max_held_splits, record=False)
        # A consumer no longer saturated matters only if a split can be taken at all.
        return want > asked[0] or (want > 0 and not set(asked[1]) <= set(saturated))

    def _room_freed(self) -> None:
        """A heartbeat long-polls the dispatcher for an interval; once there is
        more room than it asked for (a split fully produced, a consumer no
        longer saturated), cut it short and ask again. Room it asked for
        already (a split taken meanwhile) does not cut it: a call saved."""
        with self._lock:
            self._nudge.set()
            asked = self._asked
        if asked is not None and self._more_room(asked):
            self._cut()

    def _cut(self) -> None:
        with self._lock:
            self._nudge.set()
            if self._poll is not None:
                self._poll.cancel()
                self._poll, self._asked = None, None

    def _register(self) -> None:
        response = self._rpc(self._stub.RegisterWorker,
                             dpb.RegisterWorkerRequest(address=self._address, versions=versions()), timeout_s=10)
        self.worker_id = response.worker_id
        self._worker_key, self._keys_secret = response.worker_key, response.keys_secret
        self.registered.set()
        set_context(worker_id=self.worker_id)
        log.info("registered with the dispatcher",
                 extra=fields(dispatcher=self._config.dispatcher, address=self._address))

    def job_key(self, job_id: int) -> bytes:
        """Job ``job_id``'s key (dpex.keys), as the dispatcher hands it to the job's loaders."""
        return keys.job_key(self._keys_secret, job_id)

    def is_job_key(self, job_id: int, given: bytes) -> bool | None:
        """Whether ``given`` is job ``job_id``'s key; None until registered (no secret yet)."""
        if not self._keys_secret:
            return None
        return keys.is_job_key(self._keys_secret, job_id, given)

    def ensure_job(self, job_id: int) -> None:
        path = self.job_path(job_id)
        if os.path.exists(path):
            if job_id not in self._jobs:  # written before this daemon started: its job dir is kept
                with open(path, "rb") as f:
                    self._know(job_id, dpb.JobDef.FromString(f.read()))
            return
        job = self._rpc(self._stub.GetJob, dpb.GetJobRequest(job_id=job_id, job_key=self.job_key(job_id)),
                        timeout_s=30).job
        # A file of this call's own: two trainers may ask about one job at once.
        fd, tmp = tempfile.mkstemp(dir=self._job_dir, prefix=f"job-{job_id}-", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(job.SerializeToString())
        os.replace(tmp, path)
        self._know(job_id, job)

    def _know(self, job_id: int, job: dpb.JobDef) -> None:
        settings = dpb.JobDef()
        settings.CopyFrom(job)
        digest = share_digest(job)
        settings.ClearField("dataset"), settings.ClearField("collate"), settings.ClearField("worker_init_fn")
        self._jobs[job_id], self._digests[job_id] = settings, digest

    def out_of_order(self, job_id: int) -> bool:
        """The job's batches may pass a busy batch process (in_order=False)."""
        job = self._jobs.get(job_id)
        return job is not None and job.out_of_order

    def share_digest(self, job_id: int) -> bytes | None:
        """The definition the job shares with others (dpex.plan.spec.share_digest; None: none)."""
        return self._digests.get(job_id)

    def _run(self) -> None:
        interval = self._config.heartbeat_interval_s
        while not self._stop.is_set():
            self._nudge.clear()
            want, saturated = self._scheduler.free_capacity(self._config.max_held_splits)
            self._scheduler.meter.window()  # each heartbeat reports the busy fraction since the last
            request = dpb.WorkerHeartbeatRequest(worker_id=self.worker_id, want_splits=want,
                                                 held_split_ids=self._scheduler.held_split_ids(),
                                                 load=self._scheduler.load(),
                                                 saturated=[dpb.ConsumerRef(job_id=j, consumer_index=c)
                                                            for j, c in saturated],
                                                 job_ids=self._kept_jobs(), worker_key=self._worker_key)
            try:
                started = time.monotonic()
                # Registered: a dispatcher outage is waited out, however long (it may come back from its journal).
                response = self._rpc(self._stub.WorkerHeartbeat, request, timeout_s=interval + 10,
                                     track=functools.partial(self._track_poll, (want, saturated)),
                                     retry_for_s=math.inf)
                self._track_poll((want, saturated), None)
                self._refusal(None)
                if response.pause and not response.splits and not response.release_split_ids:
                    # The dispatcher holds no more polls (a huge fleet), or is
                    # stopping: pause the rest of the interval (until room frees here).
                    self._nudge.wait(interval - (time.monotonic() - started))
                self._scheduler.release(response.release_split_ids)
                for job_id in response.forget_job_ids:
                    self._forget_job(job_id)
                for split in response.splits:
                    log.debug("split taken", extra=fields(job_id=split.job_id, split_id=split.split_id,
                                                          consumer=split.consumer_index, epoch=split.epoch,
                                                          first_seq=split.first_seq, batches=split.num_batches))
                    self.ensure_job(split.job_id)
                    self._scheduler.add_split(split)
            except DpexCancelledError:  # cut short by _cut: ask again, now for splits
                continue
            except DpexNotFoundError:
                if self._stop.is_set():
                    return
                log.warning("the dispatcher no longer knows this worker; registering again")
                self._scheduler.release_all()
                try:
                    self._register()
                except DpexError as e:
                    log.error("registration failed: %s", e)
                    self._stop.wait(interval)
                continue
            except DpexConnectionError as e:
                log.warning("%s; still retrying", e)
                continue
            except DpexError as e:  # e.g. DpexAuthError: a wrong token
                log.error("heartbeat failed: %s", e)
                self._refusal(e)
                self._stop.wait(interval)
                continue
            # No pause otherwise: the dispatcher long-polls each heartbeat for up to an interval.

    def _refusal(self, error: DpexError | None) -> None:
        """Tells the server when the dispatcher starts or stops refusing our token."""
        refused = isinstance(error, DpexAuthError)
        if refused != self._refused:
            self._refused = refused
            if not refused:
                log.warning("the dispatcher takes this worker's token again")
            self._on_refused(refused)

    def close(self, deregister: bool = False) -> None:
        """Stops heartbeats; with ``deregister``, tells the dispatcher we leave
        so that it re-plans our splits now rather than at the heartbeat timeout."""
        self._stop.set()
        self._cut()  # cuts a heartbeat's long poll short: no waiting out the interval
        if self._thread.is_alive():
            self._thread.join()
        if deregister and self.registered.is_set():
            try:
                call(self._stub.DeregisterWorker, dpb.DeregisterWorkerRequest(worker_id=self.worker_id,
                                                                              worker_key=self._worker_key),
                     target=f"dispatcher {self._config.dispatcher}", timeout_s=5)
            except DpexError as e:
                log.warning("could not deregister (%s); the heartbeat timeout will do it", e)
        self._channel.close()
