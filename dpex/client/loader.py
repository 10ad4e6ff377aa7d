"""RemoteDataLoader: iterate batches that Dpex workers produced.

The epoch's plan is made here, in the trainer, by torch's own samplers
driven exactly as torch.utils.data.DataLoader drives them (it *is* a
DataLoader over indices), so the same seed gives the same batches.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator, Sequence

import torch.utils.data as tud

from dpex import finalizers
from dpex.client import checkpoint, job as jobs, seen
from dpex.client.distributed import current_run
from dpex.client.epoch import Epochs
from dpex.client.options import LoaderOptions
from dpex.client.pinning import PinnedFrames, pin_target
from dpex.client.sampling import EpochPlans, check_iterable_args, check_sampling, coordinated
from dpex.client.session import Session
from dpex.client.stats import LoaderStats, StatsMeter
from dpex.auth import load_ca, load_token
from dpex.dataset import Constant, DatasetSpec
from dpex.launch.head import resolve
from dpex.errors import DpexConfigError
from dpex.proto import dispatcher_pb2 as dpb
from dpex.rpc import check_usable

log = logging.getLogger("dpex.client")


def _start_method(context: Any) -> str | None:
    """A multiprocessing context (as torch's DataLoader takes it) as its start method's name."""
    if context is None or isinstance(context, str):
        return context
    return context.get_start_method()


def _rebuild(cls: type, args: dict[str, Any]) -> Any:
    return cls(**args)


_O = LoaderOptions  # its fields' defaults are the loader's


class RemoteDataLoader:
    """Batches produced by Dpex workers, equal to what torch's DataLoader yields.

    Each ``iter()`` is an epoch of its own, as torch's (one still read goes on beside it:
    ``zip(loader, loader)``, dpex.client.lanes); leaving it early (a ``break``, a dropped iterator,
    ``close()``) cancels it and the workers drop what they hold for it. A random sampler draws from the
    generator when torch's DataLoader would (dpex.client.paced), so a peek or a ``break`` leaves it where
    torch leaves it. Each worker process seeds itself from the epoch's base seed plus its id, sets
    ``get_worker_info()`` and calls ``worker_init_fn`` as torch's workers do.

    Args:
        address: the dispatcher's ``HOST:PORT`` (or ``dpex://HOST:PORT``); None: this process's shared embedded
            cluster; ``"auto"`` and Ray addresses as ``DpexDataLoader``'s ``head_address`` (dpex.launch.head).
        dataset: a :class:`DatasetSpec` (built on the workers from their own files) or a dataset (shipped by value).
        batch_size: samples a batch; None: no auto-batching, as torch's.
        shuffle: a random order each epoch (from ``seed``/``generator``, else torch's global RNG).
        seed: a ``torch.Generator`` seeded with it drives the shuffle; None: torch's global RNG.
        drop_last: drop the last, short batch, as torch's.
        sampler: any torch sampler (``DistributedSampler`` included), as torch's.
        batch_sampler: any torch batch sampler, as torch's.
        collate_fn: run on the workers, as torch's (default: ``default_collate``).
        num_consumers: trainers (DDP ranks) sharing the job; default: the world size under torch.distributed, else 1.
        consumer_index: this trainer's index; default: the rank under torch.distributed, else 0.
        job_name: share one job across loaders of the same definition (a rerun takes its job over);
            None: the loader's own job, or the DDP run's (``loader.job_name``).
        ordered: batches in plan order (torch's ``in_order=True``); False: as they arrive.
        timeout: seconds to wait for the next batch, and to ride out a dispatcher's outage once it was
            reached; None: as long as it takes (an epoch then fails once there has been no live worker
            for ``connect_timeout``).
        generator: drives the shuffle and the base seed, as torch's.
        window: batches requested ahead; None: 4 per live worker.
        worker_init_fn: called with the worker's id in each batch process, once an epoch (persistent: once).
        persistent_workers: keep the first ``iter()``'s dataset and run ``worker_init_fn`` once, as torch's.
        pin_memory: pin batches when an accelerator is present, as torch's: ahead of the loop, in a thread of its own.
        num_workers: the streams an IterableDataset is iterated by (each sees itself as worker k of
            ``num_workers``); 0: one stream that sees what torch's main process sees.
        processes: an embedded cluster's batch processes; None: one per core.
        auth_token: sent with every call; None: ``$DPEX_AUTH_TOKEN``.
        tls_ca: a PEM file to verify TLS daemons with; None: ``$DPEX_TLS_CA`` (no TLS without either).
        connect_timeout: seconds an unreachable dispatcher is retried before it was first reached.
        shared_memory: map a same-host worker's batches from its ``/dev/shm`` files; False: always gRPC.
        compression: ``"lz4"`` or ``"zstd"`` on the workers, worth it where the network is the limit.
        pin_memory_device: where to pin; "": the current accelerator.
        shard: several consumers and no sampler plan ``DistributedSampler``'s shares; False: the whole
            dataset on every consumer, as torch's DataLoader.
        compact_plans: send torch's samplers as descriptions the workers expand (they need the
            trainer's torch release); False: every index.
        multiprocessing_context: how an embedded cluster's worker starts: ``"fork"`` (multiprocessing's
            default on Linux) forks it from this process, as torch forks its workers, else spawned.
        reproducible: key a sample's random draws (torch, numpy, ``random``) by the epoch's base seed and
            its place in the plan (dpex.seeding): the same on any worker, after failures and resume;
            False: each process's generators run on from its worker seed, as torch's.
        share: equal jobs (a sweep's trials) get each batch made once on a worker, bitwise (dpex.worker.sharing).
        cache: ``"memory"`` or ``"disk"``: keep a dataset's unchanging samples on the workers (dpex.worker.samples).
        prefetch_factor: index batches asked per worker at ``iter()``, as torch's.
        even_batches: every consumer as many batches: ``"shortest"`` stops all at the fewest,
            ``"longest"`` (or True) repeats a short rank's first batch; False: torch's counts and a
            warning (dpex.plan.even).
        lengths: a length per sample, or a function of one: coordinated reads (dpex.BucketBatchSampler).

    Raises:
        DpexConfigError: an argument torch or Dpex refuses (torch's messages for torch's arguments).
    """

    def __init__(self, address: str | None = _O.address, dataset: Any = None, batch_size: int | None = _O.batch_size,
                 shuffle: bool | None = _O.shuffle, seed: int | None = _O.seed, drop_last: bool = _O.drop_last,
                 sampler: Any = None, batch_sampler: Any = None,
                 collate_fn: Callable[[list], Any] | None = None, num_consumers: int | None = None,
                 consumer_index: int | None = None, job_name: str | None = _O.job_name, ordered: bool = _O.ordered,
                 timeout: float | None = _O.timeout_s, *, generator: Any = None, window: int | None = _O.window,
                 worker_init_fn: Callable[[int], None] | None = None,
                 persistent_workers: bool = _O.persistent_workers, pin_memory: bool = _O.pin_memory,
                 num_workers: int = _O.num_workers, processes: int | None = _O.processes,
                 auth_token: str | None = _O.auth_token, tls_ca: str | None = _O.tls_ca,
                 connect_timeout: float = _O.connect_timeout_s, shared_memory: bool = _O.shared_memory,
                 compression: str | None = _O.compression, pin_memory_device: str = _O.pin_memory_device,
                 shard: bool = _O.shard, compact_plans: bool = _O.compact_plans, multiprocessing_context: Any = None,
                 reproducible: bool = _O.reproducible, share: bool = _O.share, cache: str | None = _O.cache,
                 prefetch_factor: int = _O.prefetch_factor, even_batches: bool | str | None = _O.even_batches,
                 lengths: Sequence[int] | Callable[[Any], int] | None = None) -> None:
        self._init_args = {name: value for name, value in locals().items() if name != "self"}  # see __reduce__
        check_usable()
        if dataset is None:
            raise DpexConfigError("RemoteDataLoader needs a dataset (a DatasetSpec or a Dataset)")
        run = None
        if num_consumers is None or (job_name is None and (num_consumers or 1) > 1):
            run = current_run(connect_timeout)
        if num_consumers is None:  # under torch.distributed: one consumer per rank
            num_consumers = run.world_size if run is not None else 1
            if consumer_index is None:
                consumer_index = run.rank if run is not None else 0
        # From here on the checked options: LoaderOptions is the one source of the loader's settings.
        self._opts = opts = LoaderOptions(
            address=address, batch_size=batch_size, drop_last=drop_last, num_consumers=num_consumers,
            consumer_index=0 if consumer_index is None else consumer_index, job_name=job_name, ordered=ordered, timeout_s=timeout,
            window=window, persistent_workers=persistent_workers, pin_memory=pin_memory,
            pin_memory_device=pin_memory_device, num_workers=num_workers, processes=processes,
            connect_timeout_s=connect_timeout, shared_memory=shared_memory, compression=compression or "",
            shuffle=shuffle, seed=seed, shard=shard, compact_plans=compact_plans, reproducible=reproducible,
            auth_token=auth_token, tls_ca=tls_ca, start_method=_start_method(multiprocessing_context),
            share=bool(share), cache=cache,
            prefetch_factor=prefetch_factor, even_batches=even_batches)
        if lengths is not None:  # coordinated reads: a step's batches across the ranks of like lengths
            dataset, batch_size, drop_last, batch_sampler = coordinated(lengths, dataset, opts, sampler, batch_sampler)
        if isinstance(dataset, tud.IterableDataset):
            check_iterable_args(shuffle, sampler, batch_sampler)
        check_sampling(batch_size, shuffle, sampler, batch_sampler, drop_last, generator, collate_fn,
                       worker_init_fn)
        self._instance = None if isinstance(dataset, DatasetSpec) else dataset
        spec = dataset if isinstance(dataset, DatasetSpec) else DatasetSpec(Constant(dataset))
        self.num_consumers, self.consumer_index = opts.num_consumers, opts.consumer_index
        self.ordered, self.timeout = opts.ordered, opts.timeout_s
        self._meter = StatsMeter()
        ca = load_ca(opts.tls_ca)
        self._code = (spec, collate_fn, worker_init_fn)
        self._code_kept = False  # persistent_workers: the first iter()'s code was shipped, and stays
        unbatched = batch_size is None and batch_sampler is None
        job = jobs.job_def(opts, self._code, bundled=self._instance is not None, unbatched=unbatched)
        derived_name = jobs.name_shared(job, run)
        self.job_name = job.name or None
        address, token, embedded_why = resolve(opts.address, load_token(token=opts.auth_token), ca,
                                               given_token=opts.auth_token)
        self._session = session = Session(address, embedded_why, token, ca, opts.shared_memory, opts.consumer_index,
                                      opts.first_contact_s, opts.timeout_s)
        self._finalizer = finalizers.finalize(self, session.close)
        try:
            if address is None:  # started in the background, shared with this process's other loaders
                from dpex.launch.embedded import embedded
                from dpex.launch.local import START_TIMEOUT_S
                session.cluster = embedded(opts.processes or os.cpu_count() or 1, token, opts.start_method)
                session.target = "the embedded dispatcher"
                # Ours (its owner reports a daemon's death); on a loaded machine it may take a while to answer.
                session.first_contact_s = max(session.first_contact_s, START_TIMEOUT_S)
            session.job_request = dpb.GetOrCreateJobRequest(job=job, settings_only=derived_name)
            if not (self.embedded and self._instance is not None):  # else at the first iter()
                session.connect()
            dataset_seen = (seen.in_trainer(dataset) if self._instance is not None else seen.on_workers(
                session.alive_workers, session.job_id, session.job_key, token, ca, session.first_contact_s,
                session.target, self.timeout))
            plans = EpochPlans(
                dataset_seen.length, dataset_seen.iterable, batch_size=batch_size, drop_last=drop_last,
                shuffle=shuffle, seed=seed, sampler=sampler, batch_sampler=batch_sampler, generator=generator,
                distributed=(opts.num_consumers > 1 or run is not None) and opts.shard,
                num_consumers=opts.num_consumers, consumer_index=opts.consumer_index,
                num_streams=max(1, opts.num_workers), compact=opts.compact_plans, unbatched=unbatched,
                reproducible=opts.reproducible, persistent=opts.persistent_workers and opts.num_workers > 0)
            pin = pin_target(opts.pin_memory_device) if opts.pin_memory else None
            if pin is not None:  # frames from other hosts arrive pinned
                session.read_frame = session.streams.read_frame = PinnedFrames(pin)
            window = opts.window or 4 * (1 if self.embedded else max(1, len(session.alive_workers())))
            self._epochs = Epochs(session, plans, dataset_seen, opts, window, pin, self._meter)
        except BaseException:
            self.close()
            raise

    # ---- public API ---------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._epochs.plans)

    @property
    def address(self) -> str:
        """The dispatcher's HOST:PORT (an embedded cluster's: once it serves)."""
        return self._session.address

    @property
    def embedded(self) -> bool:
        """Its workers are this process's embedded cluster's, on this machine."""
        return self._session.embedded

    @property
    def job_id(self) -> int | None:
        """The job's id at the dispatcher (as `dpex status` shows it); None until it is made."""
        return self._session.job_id

    def set_epoch(self, epoch: int) -> None:
        """Forwards ``epoch`` to the samplers that have ``set_epoch`` (DistributedSampler's shuffle).

        Args:
            epoch: the epoch the next ``iter()`` plans."""
        self._epochs.plans.set_epoch(epoch)

    def plan_of(self, step: int, epoch: int | None = None) -> dict[int, list[int]]:
        """The dataset indices each rank gets at a step, by rank, from the epoch's description.

        Args:
            step: the batch's place in the epoch.
            epoch: the epoch ``set_epoch(epoch)`` plans (an order that follows the epoch); None: the
                epoch in progress, or last begun.
        Returns:
            ``{rank: indices}`` (a user's sampler: this rank's only).
        Raises:
            DpexConfigError: no such epoch or step, an IterableDataset, a user's sampler's other ranks."""
        return self._epochs.plan_of(step, epoch)

    def skip(self, steps: int | range) -> int:
        """Passes over steps of the epoch in progress, as after a loss spike.

        Never fetched nor given, counted delivered, kept skipped through a resume; every rank skips alike.

        Args:
            steps: a range of steps not given yet, or how many of the next.
        Returns:
            How many were skipped.
        Raises:
            DpexConfigError: no map-style epoch in progress, steps given or past it, pin_memory."""
        return self._epochs.skip(steps)

    def __iter__(self) -> Iterator[Any]:
        if self._finalizer.alive is False:
            raise DpexConfigError("this RemoteDataLoader is closed")
        if self._instance is not None:
            self._ship_dataset()
        self._session.connect()
        return self._epochs.begin(self)  # as torch's iterator, the epoch keeps its loader alive

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, to save with a checkpoint: call it between batches.

        Plain JSON-safe values, for ``torch.save`` or ``json.dumps``; :meth:`load_state_dict` takes it
        (torch's global RNG, which a shuffle without ``generator``/``seed`` draws from, is the caller's).
        Returns:
            The state dict."""
        return {"format": checkpoint.FORMAT, "version": checkpoint.VERSION,
                "job_name": self.job_name, "named_job": bool(self._opts.job_name),
                "dataset_length": self._epochs.plans.length, "batch_size": self._opts.batch_size,
                "drop_last": self._opts.drop_last, "num_consumers": self.num_consumers,
                "consumer_index": self.consumer_index, **self._epochs.state()}

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continues from the :meth:`state_dict` of a loader built with the same arguments.

        In any process, the next ``iter()`` yields the saved epoch's batches the loop had not been given.

        Args:
            state_dict: one state dict, or under DDP the list of every rank's: as many ranks as saved
                it take their own; another number (elastic) shares out the interrupted epoch's samples
                no rank was given by DistributedSampler's rule, and plans the next for the new ranks.
        Raises:
            DpexConfigError: a state of another dataset length, batch size, job name or format."""
        if isinstance(state_dict, tuple):
            state_dict = list(state_dict)
        for sd in state_dict if isinstance(state_dict, list) else [state_dict]:
            checkpoint.check(sd, self._epochs.plans.length, self._opts.batch_size)
        self._epochs.load(*checkpoint.select(state_dict, self.num_consumers, self.consumer_index,
                                             self.job_name if self._opts.job_name else None))

    def stats(self, reset: bool = False) -> LoaderStats:
        """Whether the trainer waits for data, why, and what more workers would give.

        Args:
            reset: start a new window after this one.
        Returns:
            The window's :class:`LoaderStats`."""
        return self._meter.stats(reset)

    def close(self) -> None:
        """Stops streams and threads, releases the job, stops an embedded cluster."""
        self._finalizer()

    def __reduce__(self) -> Any:
        """Pickles to its arguments: unpickled (a spawned rank) it is a new
        loader of them: the same dispatcher, or that process's own embedded
        cluster (``address=None``); its epochs and state are not carried."""
        return _rebuild, (type(self), self._init_args)

    def __enter__(self) -> "RemoteDataLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------
    def _ship_dataset(self) -> None:
        """As torch hands the dataset to its workers at ``iter()``: a dataset
        instance (or worker_init_fn, collate_fn) changed since the job was
        made goes to the workers as a new job. Unchanged (the same pickle),
        nothing is sent. A named or DDP-shared job keeps its definition, and
        with ``persistent_workers`` the first ``iter()``'s stays, as torch's
        persistent workers keep the dataset they were given."""
        job = self._session.job_request.job
        if job.name or self._code_kept:
            return
        self._code_kept = job.persistent_workers
        fields = jobs.code_fields(*self._code, bundled=True)
        if fields["dataset"] == job.dataset:
            return
        for name, value in fields.items():
            setattr(job, name, value)
        job.content = jobs.content(self._code)
        self._epochs.dataset = seen.in_trainer(self._instance)
        self._epochs.plans.resize(self._epochs.dataset.length)
        if self.job_id is not None:  # else not made yet: connect() makes it of this definition
            self._session.renew_job()
