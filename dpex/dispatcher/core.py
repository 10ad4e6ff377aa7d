"""The dispatcher without gRPC: validates requests, turns them into updates
and applies them through the journaled state (dpex.dispatcher.journaled);
the long polls are dpex.dispatcher.polls, the reaper dpex.dispatcher.reaper.
Protos in, protos out, DpexErrors raised; ``peer`` is the caller's address
as gRPC names it (``ipv4:127.0.0.1:5555``). dpex.dispatcher.service is the
gRPC table in front of it, as tf.data service's grpc_dispatcher_impl is
before dispatcher_impl. No data plane work here.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py."""
from __future__ import annotations

import logging
import secrets

from dpex import keys, version
from dpex.address import check_address
from dpex.dispatcher import assignment, polls
from dpex.dispatcher.journaled import Journaled
from dpex.dispatcher.liveness import unreachable
from dpex.dispatcher.state import Plan
from dpex.dispatcher.status import status
from dpex.log import fields
from dpex.plan import samplers
from dpex.plan.spec import CODE, PlanHash, differing_fields, of_loader, plan_share_key, resumed
from dpex.errors import DpexConfigError, DpexConflictError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")


class DispatcherCore(Journaled):
    """The dispatcher's calls, each a method taking its request and the caller's peer."""

    # ---- workers ----------------------------------------------------------
    def register_worker(self, request, peer: str):
        self.trusted_only(peer, "registers workers (whose batches trainers unpickle)")
        if check_address(request.address) != request.address:  # trainers dial it: one that is not HOST:PORT fails them
            raise DpexConfigError(f"bad address {request.address!r}: a worker registers as HOST:PORT")
        if request.versions.protocol != version.PROTOCOL:
            raise DpexConfigError(
                f"this worker speaks another Dpex protocol: it is {version.describe(request.versions)}, the "
                f"dispatcher {version.describe()}; install the same dpex release on the dispatcher and workers")
        worker_id = "w-" + secrets.token_hex(4)
        with self.lock:
            self.apply(register_worker=jpb.RegisterWorker(worker_id=worker_id, address=request.address,
                                                          versions=request.versions))
            self.seen.worker(worker_id)
            self.seen.keep_workers(self.state.workers)  # one replaced on this address is gone
        log.info("worker registered", extra=fields(worker_id=worker_id, address=request.address,
                                                   versions=version.describe(request.versions)))
        return dpb.RegisterWorkerResponse(worker_id=worker_id, worker_key=keys.worker_key(self.keys.secret, worker_id),
                                          keys_secret=self.keys.secret)

    async def worker_heartbeat(self, request, peer: str):
        self.trusted_only(peer, "answers workers")
        return await polls.heartbeat(self, request, peer)

    def deregister_worker(self, request, peer: str):
        self.trusted_only(peer, "answers workers")
        with self.lock:
            worker = self.state.workers.get(request.worker_id)
            if worker is not None:
                self.keys.check_worker(worker.worker_id, request.worker_key, peer, "DeregisterWorker")
            if worker is not None and worker.alive:
                log.info("worker is leaving; re-planning its splits",
                         extra=fields(worker_id=worker.worker_id, address=worker.address,
                                      splits_replanned=len(worker.held)))
                self.lose_worker(worker.worker_id, left=True)
        return dpb.DeregisterWorkerResponse()

    def report_worker(self, request, peer: str):
        self.trusted_only(peer, "takes reports of workers")
        with self.lock:
            reported = [w.worker_id for w in self.state.alive_workers() if w.address == request.address]
        if not reported:
            return dpb.ReportWorkerResponse(lost=False)
        why = unreachable(request.address)  # the lock is not held across the probe
        if why is None:  # a healthy worker whose stream broke for another reason stays
            log.info("a trainer's stream to a worker broke, but the worker accepts connections; keeping it",
                     extra=fields(address=request.address, trainer=peer, error=request.error))
            return dpb.ReportWorkerResponse(lost=False)
        lost = False
        with self.lock:
            for worker_id in reported:
                worker = self.state.workers.get(worker_id)
                if worker is not None and worker.alive:
                    log.warning("worker is gone (a trainer's stream to it broke and its port refuses "
                                "connections: %s); marking it lost", why,
                                extra=fields(worker_id=worker_id, address=worker.address,
                                             splits_replanned=len(worker.held), trainer=peer))
                    self.lose_worker(worker_id)
                    lost = True
        return dpb.ReportWorkerResponse(lost=lost)

    # ---- jobs and plans -----------------------------------------------------
    def get_or_create_job(self, request, peer: str):
        self.trusted_only(peer, "takes jobs (which carry code for the workers)")
        job = request.job
        if job.num_consumers < 1:
            raise DpexConfigError("num_consumers must be >= 1")
        if not job.dataset:
            raise DpexConfigError("the job has no dataset")
        with self.lock:
            existing = self.state.find_job(job.name) if job.name else None
            if existing is not None:
                differ = differing_fields(existing.definition, job, request.settings_only)
                if differ:
                    hint = ("" if not CODE & set(differ) else
                            " (what the code is differs: its data, e.g. a tensor's bytes, or its classes' and "
                            "functions' code)" if job.content and existing.definition.content else
                            " (from an older Dpex: a dataset or function pickled by value - a class or function "
                            "defined in __main__ - pickles differently in each process: name it with "
                            "DatasetSpec('module:attr') to share a job across processes)")
                    values = "; ".join(f"{name}={getattr(job, name)!r} here, {getattr(existing.definition, name)!r} "
                                       "in the job" for name in differ if name in dpb.JobDef.DESCRIPTOR.fields_by_name
                                       and name not in CODE)
                    raise DpexConflictError(
                        f"job {job.name!r} already exists with a different {', '.join(differ)}"
                        f"{f' ({values})' if values else ''}; use another job_name or the same arguments{hint}")
                self.seen.job(existing.job_id)
                return dpb.GetOrCreateJobResponse(job_id=existing.job_id, created=False,
                                                  job_key=keys.job_key(self.keys.secret, existing.job_id))
            job_id = secrets.randbits(63)
            self.apply(create_job=jpb.CreateJob(job_id=job_id, job=job))
            self.seen.job(job_id)
        log.info("job created", extra=fields(job_id=job_id, job_name=job.name,
                                             consumers=job.num_consumers, peer=peer))
        return dpb.GetOrCreateJobResponse(job_id=job_id, created=True, job_key=keys.job_key(self.keys.secret, job_id))

    def get_job(self, request, peer: str):
        self.trusted_only(peer, "answers workers")
        with self.lock:
            return dpb.GetJobResponse(job=self.job_of(request, peer, "GetJob").definition)

    def submit_plan(self, request, peer: str):
        self.trusted_only(peer, "takes plans")
        if sum(map(bool, (request.num_streams, request.batches or request.upload_id,
                          request.HasField("sampler")))) > 1:
            raise DpexConfigError("a plan has one of batches, a sampler or streams")
        meta = (request.job_id, request.consumer_index, request.epoch, request.base_seed)
        plan_file, sampler = "", None
        if request.HasField("sampler"):
            sampler = request.sampler
            samplers.validate(sampler)
            num_batches = samplers.num_batches(sampler)
            digest = PlanHash(request.base_seed, 0, sampler).digest()
        elif request.num_streams:
            num_batches, digest = 0, PlanHash(request.base_seed, request.num_streams).digest()
        else:  # explicit batches: on disk, chunk by chunk
            with self.lock:
                self.job_of(request, peer, "SubmitPlan")
            upload_id = request.upload_id or secrets.randbits(63) + 1
            try:
                upload = self.plan_files.add(upload_id, request.chunk, request.batches,
                                              self.config.split_size_batches, meta)
                self._check_plan_size(upload.num_batches, partial=True)  # not the whole upload first
                if request.more:
                    return dpb.SubmitPlanResponse(num_batches=upload.num_batches)
                plan_file, num_batches, digest = self.plan_files.finish(upload_id)
            except OSError as e:  # a full disk: an outage, as the journal's (the upload is sent again)
                self.store.refuse(e, "its plan files")
        content, digest = digest, of_loader(resumed(digest, request.done, request.resume_id), request.client_id,
                                            request.attempt)
        self._check_plan_size(num_batches)
        with self.lock:
            job = self.job_of(request, peer, "SubmitPlan")
            if request.consumer_index >= job.definition.num_consumers:
                raise DpexConfigError(f"consumer_index {request.consumer_index} is out of range for "
                                      f"a job with {job.definition.num_consumers} consumers")
            self.claim(request, peer, job.definition.name, takeover=bool(request.resume_id))
            self.seen.consumer(request.job_id, request.consumer_index)
            same = self.state.plan(request.job_id, request.consumer_index, request.epoch)
            if same is not None and same.plan_hash == digest:  # a reconnect: nothing changes
                return dpb.SubmitPlanResponse(num_batches=same.num_batches, num_delivered=same.num_delivered)
            plan: Plan = self.apply(submit_plan=jpb.SubmitPlan(
                job_id=request.job_id, consumer_index=request.consumer_index, epoch=request.epoch,
                plan_hash=digest, split_size=self.config.split_size_batches, base_seed=request.base_seed,
                num_streams=request.num_streams, sampler=sampler, plan_file=plan_file, num_batches=num_batches,
                attempt=request.attempt, done=request.done, stream_starts=request.stream_starts,
                share_key=b"" if request.num_streams else plan_share_key(job.share_digest, content, request.epoch)))
            log.info("plan submitted", extra=fields(job_id=request.job_id, consumer=request.consumer_index,
                                                    epoch=request.epoch, batches=plan.num_batches,
                                                    splits=plan.num_splits,
                                                    kind="sampler" if sampler else "file" if plan_file else "streams"))
            alive = self.state.alive_workers()
            if alive and not any(assignment.serves(w, plan) for w in alive):
                log.warning("no live worker has torch %s, with which the trainer described this epoch's sampler: "
                            "its splits wait for one (install that torch release on the workers)",
                            plan.sampler.torch_version, extra=fields(job_id=request.job_id, epoch=request.epoch))
            return dpb.SubmitPlanResponse(num_batches=plan.num_batches, num_delivered=plan.num_delivered)

    def _check_plan_size(self, num_batches: int, partial: bool = False) -> None:
        """A plan over --max-plan-batches is refused (``partial``: the batches uploaded so far)."""
        if num_batches > self.config.max_plan_batches:
            raise DpexConfigError(f"a plan of {'at least ' if partial else ''}{num_batches} batches is over this "
                                  f"dispatcher's limit of {self.config.max_plan_batches} (--max-plan-batches)")

    async def sync_consumer(self, request, peer: str):
        self.trusted_only(peer, "syncs trainers")
        return await polls.sync(self, request, peer)

    def release_consumer(self, request, peer: str):
        self.trusted_only(peer, "releases trainers' epochs")
        with self.lock:
            if request.job_id in self.state.jobs:  # a job gone has nothing to release
                self.keys.check_job(request.job_id, request.job_key, peer, "ReleaseConsumer")
            key = (request.job_id, request.consumer_index)
            if not self.claims.holds(key, request.client_id):  # another loader's: not this one's to end
                return dpb.ReleaseConsumerResponse()
            if not request.HasField("epoch"):
                self.claims.release(key, request.client_id)
            closed = not request.HasField("epoch")  # no epoch: the loader is closing
            plan = self.state.plan(request.job_id, request.consumer_index,
                                    None if closed else request.epoch)
            job = self.state.jobs.get(request.job_id)
            if plan is None and not (closed and job is not None and request.consumer_index in job.epochs):
                return dpb.ReleaseConsumerResponse()  # nothing, or a newer epoch: keep it
            if not closed and request.attempt and plan.attempt and plan.attempt != request.attempt:
                return dpb.ReleaseConsumerResponse()  # the epoch begun again since (a late release): keep it
            self.seen.forget_consumer(request.job_id, request.consumer_index)
            release = jpb.ReleaseConsumer(job_id=request.job_id, consumer_index=request.consumer_index,
                                          closed=closed)
            if plan is not None:
                release.epoch = plan.epoch
            self.apply(release_consumer=release)
        return dpb.ReleaseConsumerResponse()

    def get_status(self, request, peer: str) -> dpb.GetStatusResponse:
        self.trusted_only(peer, "tells its status")
        return self.status()

    def status(self) -> dpb.GetStatusResponse:
        """Workers, jobs and counters, for `dpex status` and the metrics endpoint."""
        return status(self)
