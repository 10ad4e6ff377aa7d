"""The child side of the worker's batch processes: each builds a job's
dataset once from the job file (a few jobs cached), becomes that job's worker
as torch's DataLoader makes its workers (seeds, WorkerInfo, worker_init_fn),
and turns a task into a complete ``Batch`` frame: dataset[i] -> collate ->
encode, with a payload or an error. The daemon side is dpex.worker.pool.
See Note [A batch's trip] in dpex/client/fetcher.py."""
from __future__ import annotations

import contextlib
import os
import signal
import time
import traceback
from collections import OrderedDict
from typing import Any, Callable, Iterator, NamedTuple, Sequence

from dpex.dataset import describe_dataset
from dpex import errors, seeding, torch_private
from dpex.procutil import die_with_parent, map_big_buffers
from dpex import shm
from dpex.shm import Handoff
from dpex.wire.batchkey import Key

_MAX_CACHED_JOBS = 8


class Task(NamedTuple):
    """What a batch process makes: batch ``key`` of the job in ``job_path``, of samples ``indices``."""
    key: Key
    job_path: str
    indices: list[int]
    base_seed: int = 0
    whole: bool = False  # an unbatched job's element that was a list: dataset[indices]
    places: Sequence[int] = ()  # each sample's place in the epoch (one for a whole element): its draws' key


class _Job(NamedTuple):
    dataset: Any
    collate: Callable[[list], Any]
    worker_init_fn: Callable[[int], None] | None
    persistent: bool
    batch_size: int
    drop_last: bool
    compression: str = ""
    unbatched: bool = False  # batch_size=None: each element (or item) is a batch, through collate alone
    length: int = -1       # len(dataset); -1: no __len__
    fingerprint: str = ""  # the dataset's own fingerprint, if it has one
    keyed: bool = True     # each sample's draws keyed by its place (dpex.seeding), not the process's
    main_process: bool = False  # num_workers=0: get_worker_info() is None, no worker_init_fn (as torch)
    sample_cache: str = ""      # "memory" or "disk": samples kept across epochs (dpex.worker.samples)
    sample_digest: bytes = b""  # the dataset's, for the sample cache: equal for jobs of one dataset


class _Context(NamedTuple):
    """What torch gives one DataLoader worker: its WorkerInfo and RNG streams."""
    info: Any
    rng: list  # seeding.global_states() (random, torch, numpy), saved on switch
    users: frozenset = frozenset()  # the generators worker_init_fn seeded: the user's, never keyed


SAMPLE_BUDGETS = (1 << 30, 8 << 30)  # the sample cache's memory and disk tiers, in bytes (WorkerConfig's)


class BatchProcess:
    """One batch process's state: which of the pool's processes it is, where
    its hand-off files go, the jobs it built (a few cached) and, per job and
    epoch, the worker torch would have made (seeds, WorkerInfo); its arena,
    slabs and view of the sample cache, made when first needed. Its methods
    run in the process (:func:`produce`, :func:`inspect`); a test may make
    one and run them here (:func:`use`)."""

    def __init__(self, worker_address: Any = "", index: int = 0, count: int = 1, handoff_dir: str | None = None,
                 handoff_min_bytes: int = shm.MIN_BYTES, slots: Any = None,
                 sample_budgets: tuple[int, int] = SAMPLE_BUDGETS) -> None:
        """``worker_address``: a str, or the pool's shared slot (a forked pool
        starts before the daemon has a port); ``index`` of ``count``: this
        process's id among the pool's, as torch's worker ids; ``slots``:
        shared with the daemon, [pid, sample being read] per process, what a death reports."""
        self._worker_address = worker_address
        self.index, self.count = index, count
        self.handoff_dir, self.handoff_min_bytes = handoff_dir, handoff_min_bytes
        self.slots, self.sample_budgets = slots, sample_budgets
        self.produced = 0
        self.arena: Any = None    # the collate arena (dpex.worker.arena), made at the first batch
        self.slabs: Any = None    # hand-off files, written in place (dpex.worker.slabs)
        self.samples: Any = None  # the view of the worker's sample cache, made at the first cached job's sample
        self.jobs: OrderedDict[int, _Job] = OrderedDict()
        self.contexts: OrderedDict[tuple, _Context] = OrderedDict()
        self.current: tuple | None = None  # the key of the context entered last

    @property
    def worker_address(self) -> str:
        """The address of the worker this process makes batches for."""
        if isinstance(self._worker_address, str):
            return self._worker_address
        return self._worker_address.value.decode()

    def load_job(self, job_id: int, job_path: str) -> _Job:
        jobs = self.jobs
        if job_id in jobs:
            jobs.move_to_end(job_id)
            return jobs[job_id]
        from torch.utils.data import default_collate, default_convert

        from dpex.proto import dispatcher_pb2 as dpb
        from dpex.wire import callables
        with open(job_path, "rb") as f:
            job = dpb.JobDef.FromString(f.read())
        if job.bundled:  # one pickle: a bound method of the dataset binds this very copy
            spec, collate_fn, worker_init_fn = callables.loads(job.dataset)
        else:
            spec = callables.loads(job.dataset)
            collate_fn = callables.loads(job.collate) if job.collate else None
            worker_init_fn = callables.loads(job.worker_init_fn) if job.worker_init_fn else None
        dataset = spec.build()
        default = default_convert if job.unbatched else default_collate  # as torch's DataLoader
        jobs[job_id] = _Job(dataset, collate_fn or default, worker_init_fn, job.persistent_workers, job.batch_size,
                            job.drop_last, job.compression, job.unbatched, *describe_dataset(dataset),
                            keyed=not job.process_seeds, main_process=job.main_process,
                            sample_cache=job.sample_cache, sample_digest=_sample_digest(job))
        while len(jobs) > _MAX_CACHED_JOBS:
            jobs.popitem(last=False)
        return jobs[job_id]

    def _get(self, job: _Job, task: Task, index: int) -> Any:
        """dataset[index], from the worker's sample cache where the job keeps its samples."""
        if not job.sample_cache:
            return job.dataset[index]
        if self.samples is None:
            from dpex.worker.samples import SampleCache
            memory = os.path.join(self.handoff_dir, "samples") if self.handoff_dir else None
            self.samples = SampleCache(memory, os.path.join(os.path.dirname(task.job_path), "samples"),
                                       *self.sample_budgets)
        return self.samples.sample(job.sample_cache, job.sample_digest, index, lambda: job.dataset[index])

    def _enter(self, job_id: int, epoch: int, base_seed: int, job: _Job) -> None:
        """Makes this process the job's worker ``index`` for ``epoch``, as
        torch's DataLoader does for its workers: seeds ``base_seed + id`` (numpy
        through torch's seed sequence), WorkerInfo, then ``worker_init_fn(id)``.
        A process serving several jobs keeps each one's RNG streams apart."""
        contexts = self.contexts
        key = (job_id,) if job.persistent else (job_id, epoch)
        if key == self.current:
            return
        if self.current in contexts:
            contexts[self.current].rng[:] = seeding.global_states()
        context = contexts.get(key)
        self.current = key
        if context is not None:
            contexts.move_to_end(key)
            seeding.restore_global_states(context.rng)
            torch_private.set_worker_info(context.info)
            return
        contexts[key] = _Context(become_worker(job, base_seed, self.index, self.count), [])
        while len(contexts) > 4 * _MAX_CACHED_JOBS:
            contexts.popitem(last=False)
        if job.worker_init_fn is not None and not job.main_process:
            marks = seeding.seed_marks()
            job.worker_init_fn(self.index)
            contexts[key] = contexts[key]._replace(users=seeding.seeded_since(marks))

    def collate(self, job: _Job, samples: list, slab: Any = None) -> Any:
        """The job's collate_fn; torch's default_collate stacks into this
        process's arena (dpex.worker.arena) instead of shared memory, or straight
        into ``slab``'s hand-off file, so the result must be encoded before the next call."""
        from torch.utils.data import default_collate
        if job.collate is not default_collate:
            return job.collate(samples)  # a user's collate_fn sees get_worker_info(), as in torch
        if self.arena is None:  # only children collate: the daemon need not import torch
            from dpex.worker.arena import Arena
            self.arena = Arena()
        return self.arena.collate(samples, slab.data if slab is not None else None)

    def _claim_slab(self, job: _Job) -> Any:
        """A hand-off file to stack this batch into, where the job's batches go
        through default_collate uncompressed and the last one was large enough to
        travel as a file; else None (the batch is copied into its file, if any).
        Its name is ``<pid>-s<n>``: this process claims its own spares first."""
        from torch.utils.data import default_collate
        if (not self.handoff_dir or job.collate is not default_collate or job.compression or self.arena is None
                or self.arena.size < self.handoff_min_bytes):
            return None
        if self.slabs is None:
            from dpex.worker.slabs import Slabs
            self.slabs = Slabs(self.handoff_dir, self.count)
        return self.slabs.claim(f"{os.getpid()}-s{self.produced + 1}", self.arena.size)

    def _in_place(self, slab: Any, stages: Stages, batch: Any) -> Handoff | None:
        """The frame of a batch stacked into ``slab``, its head written before its
        data; None where it cannot be (the batch is then copied into a file)."""
        import functools

        from dpex.wire.codec import encode_placed
        from dpex.wire.frame import frame_head
        if self.arena.overflowed:
            return None
        head, copies, size = encode_placed(batch, functools.partial(self.slabs.offset_of, slab), self.arena.size)
        serialized = stages.header().SerializeToString()
        return self.slabs.finish(slab, frame_head(serialized, head, size), copies, size, serialized)

    def produce(self, task: Task) -> bytes | Handoff:
        """A whole Batch frame, with a payload or an error (a large one as a
        hand-off file: see dpex.shm)."""
        from dpex.wire import encode_parts, frame_parts
        from dpex.wire.compression import compress
        stages = Stages(task.key.header(processes=self.count), "build")
        meta, index, slab = stages.meta, -1, None
        try:
            job = self.load_job(task.key.job_id, task.job_path)
            meta.dataset_length, meta.dataset_fingerprint = job.length, job.fingerprint
            stages.stage = "worker_init_fn"
            self._enter(task.key.job_id, task.key.epoch, task.base_seed, job)
            # What torch's map-style fetcher reads: one element without auto-batching
            # (a list element as dataset[list]), else via __getitems__ if the dataset has one.
            dataset = job.dataset
            places = task.places if job.keyed else ()
            with stages.timed("getitem", "dataset"):
                if job.unbatched:
                    index = -1 if task.whole else task.indices[0]
                    self._reading(index)
                    self._seed_sample(task, places, 0)
                    samples = dataset[list(task.indices)] if task.whole else self._get(job, task, index)
                    self._reading(-1)
                elif getattr(dataset, "__getitems__", None) and not job.sample_cache:
                    self._seed_sample(task, places, 0)  # one call for the batch: keyed by its first sample
                    samples = dataset.__getitems__(list(task.indices))
                else:
                    samples = []
                    for i, index in enumerate(task.indices):
                        self._reading(index)
                        self._seed_sample(task, places, i)
                        samples.append(self._get(job, task, index))
                    self._reading(-1)
            stages.stage, index = "collate", -1
            if places:
                seeding.seed_globals(seeding.for_collate(task.base_seed, places[0]), self.contexts[self.current].users)
            slab = self._claim_slab(job)
            with stages.timed("collate", "collate"):
                batch = self.collate(job, samples, slab)
            seeding.clear()
            stages.stage = "encode"
            done = self._in_place(slab, stages, batch) if slab is not None else None
            if done is not None:
                self.produced += 1
                return done
            parts = encode_parts(batch)
            if job.compression:
                meta.raw_size = sum(memoryview(p).nbytes for p in parts)
                meta.compression = job.compression
                parts = [compress(job.compression, parts)]
            parts = frame_parts(stages.header(), parts)
        except Exception as e:
            seeding.clear()
            if slab is not None:
                self.slabs.release(slab)
            return stages.failed(self.remote_error(e, stages.stage, index))
        self.produced += 1
        frame = shm.frame(self.handoff_dir, self.handoff_min_bytes, f"{os.getpid()}-{self.produced}",
                          parts, self.count)
        if slab is not None:  # stacked into, then copied: a spare again
            self.slabs.release(slab)
        return frame

    def _seed_sample(self, task: Task, places: Sequence[int], i: int) -> None:
        """Keys the process's generators to sample ``i`` of the task (a job with
        keyed draws; else they run on, as in torch's workers)."""
        if places:
            seeding.seed_globals(seeding.for_sample(task.base_seed, places[i]), self.contexts[self.current].users)

    def _reading(self, index: int) -> None:
        """Says which sample this process reads (-1: none), for the report of its death (a segfault)."""
        if self.slots is not None:
            self.slots[2 * self.index + 1] = index

    def remote_error(self, e: BaseException, stage: str, index: int = -1, process: int | None = None):
        """The exception being handled, as its batch's error (dpex.errors.remote)."""
        return errors.remote(type(e), str(e), stage=stage, worker=self.worker_address, sample_index=index,
                             traceback=traceback.format_exc(), process=self.index if process is None else process)

    def inspect(self, job_id: int, job_path: str) -> bytes:
        """Builds the dataset and reports its length."""
        from dpex.proto import worker_pb2 as wpb
        try:
            from torch.utils.data import IterableDataset
            job = self.load_job(job_id, job_path)
            return wpb.InspectResponse(length=job.length, iterable=isinstance(job.dataset, IterableDataset),
                                       fingerprint=job.fingerprint).SerializeToString()
        except Exception as e:
            return wpb.InspectResponse(length=-1, error=self.remote_error(e, "build")).SerializeToString()


class _SchedStat:
    """How long this process's main thread has waited, runnable, for a core
    (Linux's /proc/self/schedstat, opened once per process, read with one pread)."""

    def __init__(self) -> None:
        self._pid, self._fd = -1, -1

    def __call__(self) -> float:
        """Seconds waited since the thread started; 0 where unknown."""
        try:
            if self._pid != os.getpid():  # a forked child reads its own
                self._pid, self._fd = os.getpid(), os.open("/proc/self/schedstat", os.O_RDONLY)
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0


_cpu_wait = _SchedStat()


class Stages:
    """A batch's way through its process, the one stage machine of produce()
    and of a stream's batches (dpex.worker.stream): the stage it is in (an
    exception raised is that stage's), the wall and CPU time of the stages
    timed (the dataset's code, collate_fn), the rest of its wall Dpex's
    (dpex.v1.StageTimes), all in its header."""

    def __init__(self, meta: Any, stage: str) -> None:
        self.meta, self.stage = meta, stage
        self._begun = time.perf_counter()
        self._timed = 0.0

    @contextlib.contextmanager
    def timed(self, stage: str, name: str) -> Iterator[None]:
        """Runs stage ``stage``, its time kept as ``name``'s (``dataset``, ``collate``)."""
        self.stage = stage
        wall, cpu, cpu_wait = time.perf_counter(), time.process_time(), _cpu_wait()
        yield
        wall, cpu, cpu_wait = time.perf_counter() - wall, time.process_time() - cpu, _cpu_wait() - cpu_wait
        setattr(self.meta.stages, f"{name}_s", wall)
        setattr(self.meta.stages, f"{name}_cpu_s", cpu)
        setattr(self.meta.stages, f"{name}_cpu_wait_s", cpu_wait)
        self._timed += wall

    def header(self) -> Any:
        """The header, its times complete: the frame is made now."""
        self.meta.stages.dpex_s = max(0.0, time.perf_counter() - self._begun - self._timed)
        return self.meta

    def failed(self, error: Any) -> bytes:
        """The frame of the batch that failed with ``error`` (a RemoteError), in the stage it was in
        (without times: a failed batch's are not a made one's)."""
        self.meta.ClearField("stages")
        self.meta.error.CopyFrom(error)
        return self.meta.SerializeToString()


def _sample_digest(job: Any) -> bytes:
    """Equal for jobs whose samples are equal: the same dataset and worker_init_fn (what they are,
    JobDef.content; from older clients, as pickled)."""
    import hashlib
    h = hashlib.sha256(b"dpex-samples-1")
    code = (job.content,) if job.content else (job.dataset, job.worker_init_fn)
    for part in (*code, b"%d%d" % (job.bundled, job.main_process)):
        h.update(hashlib.sha256(part).digest())
    return h.digest()[:16]


def become_worker(job: _Job, base_seed: int, worker_id: int, num_workers: int) -> Any:
    """torch's worker set-up: seeds from ``base_seed + id`` and WorkerInfo
    (None for a job of ``num_workers=0``: torch's main process has none)."""
    import random

    import numpy as np
    import torch
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_private.numpy_worker_seed(base_seed, worker_id))
    info = None if job.main_process else torch_private.worker_info(id=worker_id, num_workers=num_workers, seed=seed,
                                                                    dataset=job.dataset)
    torch_private.set_worker_info(info)
    return info


# ---- the process's entry points: what the pool runs, by name ---------------------------
_process = BatchProcess()  # this process's; init_child (or a test's use()) gives it its own


def use(process: BatchProcess) -> BatchProcess:
    """Makes ``process`` this process's; the one it replaces."""
    global _process
    old, _process = _process, process
    return old


def current() -> BatchProcess:
    return _process


def init_child(worker_address: Any, counter: Any, num_children: int, handoff_dir: str | None,
               handoff_min_bytes: int, daemon_pid: int | None = None, slots: Any = None,
               sample_budgets: tuple[int, int] = SAMPLE_BUDGETS) -> None:
    """A pool's initializer: this process becomes the pool's next batch process."""
    with counter.get_lock():  # each child of a pool gets its own id, as torch's workers
        index = counter.value
        counter.value += 1
    if slots is not None:
        slots[2 * index] = os.getpid()
    use(BatchProcess(worker_address, index, num_children, handoff_dir, handoff_min_bytes, slots, sample_budgets))
    init_process(worker_address, daemon_pid)


def init_process(worker_address: Any, daemon_pid: int | None = None) -> None:
    """Set-up of every process that runs user code for a worker
    (``worker_address``: a str, or a shared char array the daemon fills in)."""
    _process._worker_address = worker_address
    # Even if the daemon is SIGKILLed; and at once if it died while this
    # process was starting (children start without the daemon waiting for them).
    die_with_parent(daemon_pid)
    map_big_buffers()  # batches are mapped and unmapped whole: they cannot fragment the heap
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's to handle
    import torch
    torch.set_num_threads(1)  # as torch's DataLoader workers: processes give the parallelism


def produce(task: Task) -> bytes | Handoff:
    """Runs in a child: :meth:`BatchProcess.produce`."""
    return _process.produce(task)


def inspect(job_id: int, job_path: str) -> bytes:
    """Runs in a child: :meth:`BatchProcess.inspect`."""
    return _process.inspect(job_id, job_path)


def load_job(job_id: int, job_path: str) -> _Job:
    return _process.load_job(job_id, job_path)


def collate(job: _Job, samples: list, slab: Any = None) -> Any:
    return _process.collate(job, samples, slab)


def remote_error(e: BaseException, stage: str, index: int = -1, process: int | None = None):
    return _process.remote_error(e, stage, index, process)


def warm_up() -> int:
    """Started at once in every child, so that none waits for the first batch."""
    return os.getpid()
