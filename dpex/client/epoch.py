"""A loader's epochs: which one ``iter()`` begins next, the one being read
(for ``state_dict()``) and the one a ``load_state_dict()`` resumes; each
epoch's plan submitted (its job made again if the dispatcher collected it)
and its fetcher built, pinned where the loader pins. What an epoch's state
dict holds is theirs (torchdata's nodes each own their ``get_state``);
the loader's other settings are the loader's.
See Note [A batch's trip] and Note [Leaving an epoch] in dpex/client/fetcher.py."""
from __future__ import annotations

import logging
import secrets
import weakref
from typing import Any, Callable, Iterator

from dpex.client import checkpoint, job as jobs
from dpex.client.checkpoint import EpochState, Progress
from dpex.client.fetcher import EpochFetcher, end_left
from dpex.client.seen import DatasetSeen
from dpex.client.lanes import Lane
from dpex.client.options import LoaderOptions
from dpex.client.paced import PacedEpoch
from dpex.client.pinning import PinnedEpoch
from dpex.client.sampling import EpochDraw, EpochPlans
from dpex.client.session import Session
from dpex.client.stats import StatsMeter
from dpex.errors import JOB_COLLECTED, DpexConfigError, DpexNotFoundError
from dpex.plan import even, samplers
from dpex.proto import dispatcher_pb2 as dpb
from dpex.wire.batchkey import EpochKey

log = logging.getLogger("dpex.client")


class Epochs:
    def __init__(self, session: Session, plans: EpochPlans, dataset: DatasetSeen, opts: LoaderOptions,
                 window: int, pin: Any, meter: StatsMeter) -> None:
        """``dataset``: what the workers (or the trainer) saw of it, checked
        against each batch; ``window``: batches asked ahead; ``pin``: the
        device batches are pinned for (None: not pinned)."""
        self.session, self.plans, self.dataset, self.opts = session, plans, dataset, opts
        self.window, self.pin, self.meter = window, pin, meter
        self.counter = 0  # one plan per iter(): torch reshuffles at every iter() too
        self.current: EpochState | None = None  # the epoch in progress, for state_dict()
        self.replicas: dict[int, bytes] = {}  # stream -> the dataset its next epoch starts from (see Progress)
        self.resume: EpochState | None = None   # from load_state_dict(), for the next iter()
        self.fetcher: Callable[[], EpochFetcher | None] = lambda: None  # the epoch in progress (weakly)

    def begin(self, owner: Any) -> Iterator[Any]:
        """The next epoch, as ``iter()`` returns it: planned and started when
        torch's iterator first asks its sampler (see dpex.client.paced).
        ``owner``: the loader, which the epoch keeps alive while it is read."""
        resume, self.resume = self.resume, None
        epoch = self.counter
        self.counter += 1
        if resume is not None:  # the epoch of a checkpoint: as it was planned, nothing drawn again
            draw = self.plans.resumed(resume.base_seed, resume.sampler, resume.drawn, resume.end)
            asked = resume.progress.count
        else:
            draw, asked = self.plans.begin(epoch), 0
        prefetch = self.opts.prefetch_factor * self.opts.num_workers if not self.plans.iterable else 1
        length = len(self.plans) if not self.plans.iterable or self.plans.length >= 0 else 0
        return PacedEpoch(lambda: self._start(epoch, draw, resume), draw, length, prefetch, asked, owner)

    def _start(self, epoch: int, draw: EpochDraw, resume: EpochState | None) -> Iterator[Any]:
        """Submits epoch ``epoch``'s plan (``draw``'s, or ``resume``'s) and returns its fetcher."""
        session = self.session
        # An epoch of its own, as torch's iter(): one still being read goes on, on its lane.
        lane = session.lanes.pick(session.open_lane, first_only=resume is not None)
        if lane.busy:
            lane.close_epoch(f"this epoch of job {lane.job_id} was left: the loader resumed from a state dict "
                             "(load_state_dict) in a new iter(), which takes its place")
        if resume is not None:
            base_seed, sampler, streams = resume.base_seed, resume.sampler, resume.num_streams
            plan = resume.batches or []
            progress = resume.progress
        else:  # a job that keeps its dataset: each stream goes on with the one the last epoch's stream left
            base_seed, sampler, plan, streams = draw.plan()
            self.replicas = self.next_replicas()
            progress = Progress(num_streams=streams, starts=self.replicas if streams else {})
        end_left(EpochKey(lane.job_id, session.consumer_index, epoch), session.client_id)  # this epoch, begun before
        attempt = secrets.randbits(63) + 1  # this iter()'s: a late release of an earlier one leaves it alone
        # "longest", resumed mid-epoch: the first batch, given before, is fetched again (to repeat if this
        # consumer's own run out; made again bitwise, its draws keyed): not marked delivered in the plan.
        given = progress.seqs() if resume is not None else set()
        again = min(given) if (given and not streams and self.opts.num_consumers > 1
                               and self.opts.even_batches == even.LONGEST) else None
        num_batches = self._submit(lane, epoch, base_seed, sampler, plan, streams, progress, resume is not None,
                                   attempt, again)
        fetcher = EpochFetcher(
            stub=session.stub, target=session.target, streams=lane.streams, job_id=lane.job_id, job_key=lane.job_key,
            consumer_index=session.consumer_index, epoch=epoch, num_batches=num_batches,
            client_id=session.client_id, window=self.window, ordered=self.opts.ordered, timeout_s=self.opts.timeout_s,
            retry_for_s=session.retry_for_s(), outage=session.outage, dataset=self.dataset, num_streams=streams,
            meter=self.meter, leave=session.releaser(lane.job_id, lane.job_key, epoch, attempt), progress=progress,
            report=session.report, health=session.health if session.embedded else None,
            no_worker_s=session.first_contact_s if self.opts.timeout_s is None else None,
            num_consumers=self.opts.num_consumers, even_batches=self.opts.even_batches, attempt=attempt, again=again)
        self.current = EpochState(epoch, base_seed, num_batches, sampler, None if sampler or streams else plan,
                                  progress, streams, resume.reshard if resume is not None else None, draw=draw)
        self.fetcher = weakref.ref(fetcher)
        iterator = fetcher if self.pin is None else PinnedEpoch(fetcher, self.pin, self.window, self.meter)
        lane.start(iterator)
        return iterator

    def _submit(self, lane: Lane, epoch: int, base_seed: int, sampler: Any, plan: list, streams: int,
                progress: Progress, resumed: bool, attempt: int, again: int | None = None) -> int:
        """Submits the epoch's plan on ``lane`` (its job made again if it was collected); its batches."""
        session = self.session
        submit = dpb.SubmitPlanRequest(job_id=lane.job_id, job_key=lane.job_key,
                                       consumer_index=session.consumer_index, epoch=epoch,
                                       base_seed=base_seed, num_streams=streams, client_id=session.client_id,
                                       attempt=attempt)
        if sampler is not None:
            submit.sampler.CopyFrom(sampler)
        if resumed:
            done = progress.ranges()
            if again is not None:  # all but that one
                done = [(a, b) for s, e in done for a, b in ((s, min(e, again)), (max(s, again + 1), e)) if a < b]
            submit.done.extend(dpb.SeqRange(start=a, end=b) for a, b in done)
            submit.resume_id = secrets.randbits(63) + 1
        for k in sorted(set(progress.stream_states) | set(progress.starts)):
            j, state = progress.stream_states.get(k, (0, b""))
            submit.stream_starts.append(dpb.StreamStart(stream=k, next=j, state=state,
                                                        replica=progress.starts.get(k, b"")))
        try:
            return jobs.submit(session.call, session.stub, submit, plan)
        except DpexNotFoundError as e:
            if JOB_COLLECTED not in str(e):
                raise
            log.warning("%s; making it again", e)  # the definition is ours: nothing is lost
            session.remake(lane)
            submit.job_id, submit.job_key = lane.job_id, lane.job_key
            return jobs.submit(session.call, session.stub, submit, plan)

    def plan_of(self, step: int, epoch: int | None = None) -> dict[int, list[int]]:
        """The indices each consumer (rank) gets at ``step`` of the epoch in progress (or last begun),
        or of the one ``set_epoch(epoch)`` plans."""
        if epoch is not None:
            spec = self.plans.describe_epoch(epoch)
            if not 0 <= step < samplers.num_batches(spec):
                raise DpexConfigError(f"step {step} is not in epoch {epoch}, of {samplers.num_batches(spec)} batches")
            return samplers.every_rank(spec, step, self.opts.consumer_index)
        current = self.resume or self.current
        if current is None:
            raise DpexConfigError("no epoch was begun yet: plan_of() reads the plan of the epoch in progress")
        if current.num_streams:
            raise DpexConfigError("an IterableDataset's batches are what its streams yield: it has no plan to read")
        if not 0 <= step < current.num_batches:
            raise DpexConfigError(f"step {step} is not in epoch {current.epoch}, of {current.num_batches} batches")
        if current.sampler is not None:  # a description: any rank's batch, computed, not drawn whole
            return samplers.every_rank(current.sampler, step, self.opts.consumer_index)
        batches = current.batches or []  # a sampler of the user's own: this rank's plan alone is here
        return {self.opts.consumer_index: list(batches[step].indices)} if step < len(batches) else {}

    def skip(self, steps: int | range) -> int:
        """Skips steps of the epoch in progress (``int``: the next that many); how many were skipped."""
        fetcher = self.fetcher()
        if fetcher is None or fetcher.closed:
            raise DpexConfigError("no epoch is in progress: skip() passes over steps of the epoch being read")
        if self.pin is not None:
            raise DpexConfigError("skip() with pin_memory=True is not supported yet: its batches are pinned ahead")
        if isinstance(steps, int):
            first = fetcher.next_step
            steps = range(first, min(first + steps, len(fetcher)))
        return fetcher.skip(steps)

    # ---- state dicts ------------------------------------------------------------------
    def next_replicas(self) -> dict[int, bytes]:
        """The datasets the next epoch's streams start from (a job that keeps its dataset; else none)."""
        current = self.resume or self.current
        return current.progress.next_starts() if current is not None and current.num_streams else self.replicas

    def state(self) -> dict[str, Any]:
        """The epochs' part of the loader's state dict."""
        current = self.resume or self.current
        sd: dict[str, Any] = {
            "epochs_started": self.counter,
            "epoch": current.to_dict() if current is not None and not current.progress.ended else None,
            "generator": None, "samplers": {},
            "first_seed": list(self.plans.first_seed) if self.plans.first_seed else None,
            "replicas": [[k, checkpoint.blob(r)] for k, r in sorted(self.next_replicas().items())]}
        if self.plans.generator is not None:
            sd["generator"] = checkpoint.pack_generator(self.plans.generator)
        for name, s in self.plans.samplers():
            if callable(getattr(s, "state_dict", None)):
                sd["samplers"][name] = s.state_dict()
        return sd

    def load(self, state_dict: dict[str, Any], resume: EpochState | None) -> None:
        """Takes up the epochs' part of a state dict (this consumer's, selected), and ``resume``
        (its interrupted epoch, if any) for the next ``iter()``."""
        self.resume = resume
        self.counter = state_dict["epochs_started"] if resume is None else resume.epoch
        first = state_dict.get("first_seed")  # persistent workers: seeded at the first iter() only
        self.plans.first_seed = (first[0], first[1]) if first else None
        self.current = None
        self.replicas = {k: checkpoint.unblob(r) for k, r in checkpoint.pairs(state_dict.get("replicas", []))}
        if state_dict["generator"] is not None and self.plans.generator is not None:
            checkpoint.restore_generator(self.plans.generator, state_dict["generator"])
        for name, s in self.plans.samplers():
            if name in state_dict["samplers"] and callable(getattr(s, "load_state_dict", None)):
                s.load_state_dict(state_dict["samplers"][name])
