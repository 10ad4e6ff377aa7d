"""The reaper: a thread that marks silent workers lost, releases silent
consumers' plans, collects workers and jobs gone for their GC timeouts,
deletes the plan files nobody needs, and has the scaling policy look at what
the trainers and workers said (dpex.dispatcher.scaling). dpex.dispatcher.server
starts and stops it."""
from __future__ import annotations

import logging
import threading

from dpex.dispatcher.journaled import Journaled
from dpex.dispatcher.scaling import Signals
from dpex.errors import DpexError
from dpex.log import fields
from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")


class Reaper:
    """Runs :meth:`reap` every second or so (a fraction of the heartbeat timeout) until stopped."""

    def __init__(self, core: Journaled) -> None:
        self._core = core
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dpex-reaper", daemon=True)

    def start(self) -> "Reaper":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        config = self._core.config
        period = min(config.heartbeat_interval_s, config.heartbeat_timeout_s / 4, 1.0)
        while not self._stop.wait(period):
            try:
                self.reap()
            except DpexError as e:  # e.g. the journal cannot be written (a full disk): again next round
                log.debug("reaping deferred: %s", e)

    def reap(self) -> None:
        """One round: silent workers lost, silent consumers released, garbage collected."""
        core, config = self._core, self._core.config
        with core.lock:
            alive = [w.worker_id for w in core.state.alive_workers()]
            for worker_id in core.seen.silent_workers(alive, config.heartbeat_timeout_s):
                worker = core.state.workers[worker_id]
                log.warning("worker missed its heartbeat timeout (%.1fs); marking it lost",
                            config.heartbeat_timeout_s,
                            extra=fields(worker_id=worker.worker_id, address=worker.address,
                                         splits_replanned=len(worker.held)))
                core.lose_worker(worker.worker_id)
            for job_id, consumer in core.seen.silent_consumers(config.consumer_timeout_s):
                if core.state.has_live_plan(job_id, consumer):
                    log.warning("consumer has not synced for %.0fs; releasing its plan (its "
                                "workers drop what they hold for it)", config.consumer_timeout_s,
                                extra=fields(job_id=job_id, consumer=consumer))
                    core.apply(release_consumer=jpb.ReleaseConsumer(job_id=job_id, consumer_index=consumer,
                                                                    closed=True))
                    core.seen.released_silent(job_id, consumer)
            self._collect()
            self._scale()
            core.plan_files.keep({p.plan_file for job in core.state.jobs.values()
                                  for p in job.plans.values() if p.plan_file and not p.finished})

    def _scale(self) -> None:
        """The policy's look at the trainers' and workers' signals; the caller holds the lock."""
        core = self._core
        if core.scaling is None:
            return
        alive = core.state.alive_workers()
        loads = [core.seen.loads[w.worker_id] for w in alive if w.worker_id in core.seen.loads]
        trainers, wait, rate, needed = core.seen.demand()
        decision = core.scaling.decide(Signals(
            now=core.seen.clock(), workers=len(alive), trainers=trainers, wait=wait, workers_needed=needed,
            busy=sum(load.busy_fraction for load in loads) / len(loads) if loads else 0.0, throughput=rate))
        if core.scaled is None or decision.target != core.scaled.target:
            log.info("workers wanted: %d (%s)", decision.target, decision.reason,
                     extra=fields(workers_wanted=decision.target, workers_alive=len(alive)))
        core.scaled = decision

    def _collect(self) -> None:
        """Garbage collection; the caller holds the lock."""
        core, config = self._core, self._core.config
        if config.worker_gc_timeout_s:
            for worker_id in core.seen.lost_for(config.worker_gc_timeout_s):
                log.info("forgetting a worker gone for %.0fs", config.worker_gc_timeout_s,
                         extra=fields(worker_id=worker_id))
                core.apply(forget_worker=jpb.ForgetWorker(worker_id=worker_id))
                core.seen.forget_worker(worker_id)
        if config.job_gc_timeout_s:
            idle = [job_id for job_id in core.state.jobs if core.state.job_state(job_id) != "running"]
            for job_id in core.seen.idle_jobs(idle, config.job_gc_timeout_s):
                log.info("removing a job without consumers for %.0fs", config.job_gc_timeout_s,
                         extra=fields(job_id=job_id, job_name=core.state.jobs[job_id].definition.name))
                core.apply(remove_job=jpb.RemoveJob(job_id=job_id))
                core.seen.forget_job(job_id)
                core.claims.forget_job(job_id)
                core.counts.forget_job(job_id)
