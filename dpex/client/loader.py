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

    ``address`` is the dispatcher's HOST:PORT (or ``dpex://HOST:PORT``); None
    is this process's embedded local cluster (``processes`` worker processes;
    see :func:`dpex.launch.embedded.embedded`), started in the background by the
    first loader that needs it and shared with the process's other loaders;
    ``"auto"`` and Ray addresses are resolved as ``DpexDataLoader``'s
    ``head_address`` (``dpex.launch.head``).
    ``dataset`` is a :class:`DatasetSpec` (built on the workers from their own
    files) or a dataset instance (shipped to the workers by value).
    ``num_consumers``/``consumer_index`` default to the world size and rank
    under torch.distributed (1/0 outside), where ranks without a ``job_name``
    share one job named after the run (``loader.job_name``). With
    ``num_consumers`` > 1 (or under torch.distributed, one rank too) and no
    sampler, consumer k plans DistributedSampler's k-th share
    (``shard=False``: the whole dataset, as torch's DataLoader).
    ``timeout`` is how many seconds to wait for the next batch before raising
    (None: wait as long as it takes), and how long an outage of the dispatcher
    is ridden out once it was reached (``connect_timeout`` before that);
    with ``timeout=None``, an epoch fails once the dispatcher has had no live
    worker for ``connect_timeout`` seconds. An embedded cluster's worker
    that dies is started again (a few times); its dispatcher's death, or
    one too many of the worker's, fails the epoch in torch's words.
    ``window`` batches are requested ahead.
    A random sampler draws from the user's generator when torch's DataLoader
    would: with ``num_workers`` > 0, ``prefetch_factor * num_workers`` index
    batches at ``iter()`` (torch's prefetch), without workers at the first
    ``next()``, then as batches are yielded; so a peek or a ``break`` leaves
    the generator where torch leaves it (see dpex.client.paced).
    As with torch's DataLoader, each worker process seeds itself from the
    epoch's base seed plus its id, sets ``get_worker_info()`` and calls
    ``worker_init_fn(id)`` (once per epoch, or once with ``persistent_workers``);
    ``pin_memory`` pins batches in the trainer when an accelerator is present,
    as torch does: ahead of the consumer, in a thread of its own with one
    intra-op thread (on ``pin_memory_device``, default the current accelerator).
    Each ``iter()`` is an epoch of its own, as torch's: one still being read
    goes on beside it (``zip(loader, loader)``; see dpex.client.lanes).
    Dropping an epoch's iterator before its end (a ``break``) or ``close()``
    leaves the epoch: workers drop what they hold for it.
    ``auth_token`` (default: $DPEX_AUTH_TOKEN) goes with every call; with
    ``tls_ca`` (a PEM file; default: $DPEX_TLS_CA) the daemons are reached over TLS.
    With ``shared_memory``, batches of a worker on this host are mapped from
    its /dev/shm files instead of streamed (False: always over gRPC).
    ``compression`` ("lz4" or "zstd"; default none) compresses payloads on
    the workers: worth it only where the network, not CPU, is the limit.
    An IterableDataset is iterated by ``num_workers`` streams, each in a
    process of its own that sees itself as worker k of ``num_workers``; its
    batches come round-robin, as from torch's workers. ``num_workers=0`` is
    one stream that sees what torch's main process sees: ``get_worker_info()``
    is None and ``worker_init_fn`` is not called (map-style jobs too).
    With ``reproducible`` (the default) a sample's random draws (torch,
    numpy, ``random``) are keyed by the epoch's base seed and the sample's
    place in the epoch's plan (see dpex.seeding), so they are the same
    whichever worker or process makes it, after failures and resume, and
    whatever the batch size or (DistributedSampler) the world size;
    ``reproducible=False`` lets each process's generators run on from its
    worker seed, as torch's workers do.
    The embedded cluster's worker and its processes are forked from this
    process when ``multiprocessing_context`` (default: multiprocessing's) is
    "fork", as torch's DataLoader forks its workers, else spawned.
    With torch's own samplers an epoch's plan is sent as a description and
    the workers compute its index batches (they need the trainer's torch
    release); ``compact_plans=False``, or any other sampler, sends every index.
    With ``share`` (the default) and keyed draws, jobs of an equal definition
    (the same dataset, code and settings; a sweep's trials) get each batch
    made once on a worker, each its own copy, bitwise what it would have
    made alone (see dpex.worker.sharing); ``share=False`` opts out.
    ``cache="memory"`` (or ``"disk"``) keeps the dataset's samples on the
    workers by index, across epochs and jobs of the same dataset, for a
    dataset whose samples do not change between epochs; it checks itself
    (see dpex.worker.samples).
    ``even_batches`` gives every consumer (DDP rank) as many batches whatever its
    data yields: ``"shortest"`` stops all at the fewest (``stats().batches_dropped``),
    ``"longest"`` (``True``, as Accelerate's) repeats a short rank's first batch
    (``stats().batches_repeated``); False, torch's counts and a warning (dpex.plan.even).
    ``lengths`` (per sample, or a function of one): coordinated reads (dpex.BucketBatchSampler, dpex.BucketedIterable).
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
        """Forwards to samplers that have ``set_epoch`` (e.g. DistributedSampler)."""
        self._epochs.plans.set_epoch(epoch)

    def plan_of(self, step: int, epoch: int | None = None) -> dict[int, list[int]]:
        """The dataset indices each rank gets at batch ``step`` of the epoch in progress (or last
        begun; ``epoch``: the one ``set_epoch(epoch)`` plans, for an order that follows the epoch),
        by rank, from its description (no permutation drawn whole for a ShuffleSampler).

        Raises:
            DpexConfigError: no such epoch or step, an IterableDataset, a user's sampler's other ranks."""
        return self._epochs.plan_of(step, epoch)

    def skip(self, steps: int | range) -> int:
        """Passes over ``steps`` (a range not given yet, or the next ``int``) of the epoch in
        progress, as after a loss spike: never fetched nor given, counted delivered, kept skipped
        through a state dict's resume; every rank skips alike. Returns how many were skipped.

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
        """Where this loader stands, to save with a checkpoint (plain JSON-safe
        values, for ``torch.save`` or ``json.dumps``): call it between batches. A loader built with the
        same arguments and given it by :meth:`load_state_dict` before ``iter()``
        yields the rest of the epoch, then the next epochs, as this one would
        (torch's global RNG, which a shuffle without ``generator``/``seed``
        draws from at each ``iter()``, is the caller's to save and restore)."""
        return {"format": checkpoint.FORMAT, "version": checkpoint.VERSION,
                "job_name": self.job_name, "named_job": bool(self._opts.job_name),
                "dataset_length": self._epochs.plans.length, "batch_size": self._opts.batch_size,
                "drop_last": self._opts.drop_last, "num_consumers": self.num_consumers,
                "consumer_index": self.consumer_index, **self._epochs.state()}

    def load_state_dict(self, state_dict: dict[str, Any] | list[dict[str, Any]]) -> None:
        """Continues from :meth:`state_dict` of a loader built with the same
        arguments (this or another process): the next ``iter()`` yields the
        batches of the saved epoch that the loop had not been given, exactly
        those, then epochs go on as the saved loader's would. Under DDP, a
        rank may be given the list of every rank's state dict: with as many
        ranks as saved it, each takes its own; with another number (elastic),
        the samples of the interrupted epoch that no rank's loop was given are
        shared out by DistributedSampler's rule (each once, padded to equal
        shares), and the next epochs are planned for the new number of ranks."""
        if isinstance(state_dict, tuple):
            state_dict = list(state_dict)
        for sd in state_dict if isinstance(state_dict, list) else [state_dict]:
            checkpoint.check(sd, self._epochs.plans.length, self._opts.batch_size)
        self._epochs.load(*checkpoint.select(state_dict, self.num_consumers, self.consumer_index,
                                             self.job_name if self._opts.job_name else None))

    def stats(self, reset: bool = False) -> LoaderStats:
        """Batches/s, bytes received, seconds the trainer waited for data and
        whether it is input-bound (waiting > 10 % of the time), with how many
        workers the measured rates call for. ``reset`` starts a new window."""
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
