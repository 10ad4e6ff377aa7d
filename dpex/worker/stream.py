"""An IterableDataset stream's process: stream k of N runs in a process of
its own, as torch's worker k does (get_worker_info() says k of N), iterates
the dataset, batches, collates and encodes; batch j is seq ``j * N + k``.
Stream processes are forked from the daemon's forkserver, which has torch
imported (forked from the daemon at its start where that is safe, else spawned).

The process sends one frame per credit the daemon grants over a pipe
(dpex.worker.runners.StreamRunner is the daemon's side), so a stream never
runs more than ``buffer_batches`` ahead of the trainer.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
from typing import Any, NamedTuple

import cloudpickle

from dpex.plan.seq import stream_seq
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import worker_pb2 as wpb
from dpex.wire import frame_parts
from dpex import seeding, stdlib, wire
from dpex.worker import runtime
from dpex.wire.batchkey import Key

log = logging.getLogger("dpex.worker")


def meta(split: Any, j: int, **fields: Any) -> wpb.Batch:
    """The metadata of stream batch j."""
    return Key(split["epoch"], stream_seq(split["stream"], j, split["num_streams"]), split["consumer_index"],
               split["job_id"], split["attempt"]).header(**fields)


_END = object()


class _Resumable(NamedTuple):
    """A stream's state after a batch: its dataset's ``state_dict()`` (None
    when the dataset is its own iterator), for a job with keyed draws its
    process's generators (else None), and its iterator's ``state_dict()``
    when the iterator is Stateful (has both methods), as torchdata saves it."""
    dataset: Any
    rng: tuple | None
    iterator: Any = None


def _stateful(obj: Any) -> bool:
    """torchdata's Stateful: ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _as_rank(consumer_index: int, job_path: str) -> None:
    """Under DDP each torch DataLoader worker inherits its rank's RANK and WORLD_SIZE (torchrun's):
    a stream's process sees its consumer's, so that an IterableDataset sharding by them (reading them,
    or webdataset's pytorch_worker_info) shards as it would under torch."""
    with open(job_path, "rb") as f:
        consumers = dpb.JobDef.FromString(f.read()).num_consumers
    if consumers > 1:
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(consumer_index), str(consumers)


def run_stream(split: dict, job_path: str, worker_address: str, conn: Any) -> None:
    """The stream process: iterate, batch, send a frame per credit, then the end."""
    runtime.init_process(worker_address)
    credits = 0

    def send(frame: bytes) -> bool:
        nonlocal credits
        while credits == 0:
            try:
                got = conn.recv()
            except EOFError:
                return False
            if got is None:
                return False
            credits += got
        credits -= 1
        conn.send_bytes(frame)
        return True

    j, stage = split["next"], "build"
    keeps = False
    try:
        _as_rank(split["consumer_index"], job_path)
        job = runtime.load_job(split["job_id"], job_path)
        # persistent_workers, or num_workers=0: torch iterates one dataset object epoch after epoch
        keeps = job.persistent or job.main_process
        if split["replica"]:  # that object as the stream of the epoch before left it
            job = job._replace(dataset=cloudpickle.loads(split["replica"]))
        stage = "worker_init_fn"
        runtime.become_worker(job, split["base_seed"], split["stream"], split["num_streams"])
        if job.worker_init_fn is not None and not job.main_process and not split["replica"]:
            job.worker_init_fn(split["stream"])  # once per worker with persistent_workers, as torch
        # Restored in torchdata's order: the dataset's state, then iter(), then the iterator's state.
        saved = _Resumable(None, None)
        if split["state"]:  # a resumed stream: where it said it was after batch next-1
            stage = "load_state_dict"
            saved = pickle.loads(split["state"])
            if not isinstance(saved, _Resumable):  # a job without keyed draws, before iterators were saved
                saved = _Resumable(saved, None)
            if saved.rng is not None:  # and where its generators were: it draws on as it would have
                seeding.restore_global_states(saved.rng)
            if saved.dataset is not None:
                job.dataset.load_state_dict(saved.dataset)
        stage = "iterate"
        samples = iter(job.dataset)
        own = samples is job.dataset  # a dataset that is its own iterator: its state is the iterator's
        if saved.iterator is not None and _stateful(samples):
            stage = "load_state_dict"
            samples.load_state_dict(saved.iterator)
        stateful = (_stateful(job.dataset) and not own, _stateful(samples))
        while True:
            # A batch's error (its items' next(), collate_fn, ...) is that batch's, and the stream goes
            # on, as torch's worker loop does: a generator that raised then ends at its next next().
            frame = _next_frame(job, samples, stateful, split, j)
            if frame is None:
                break
            if not send(frame):
                return
            j += 1
    except Exception as e:
        failed = meta(split, j, error=runtime.remote_error(e, stage, process=split["stream"]))
        if not send(failed.SerializeToString()):
            return
        j += 1
        keeps = False
    # The dataset as this epoch leaves it, for the next epoch's stream k (which may run on another worker).
    send(meta(split, j, end_of_stream=True, stream_state=_replica(job.dataset) if keeps else b"").SerializeToString())


def _next_frame(job: Any, samples: Any, stateful: tuple[bool, bool], split: dict, j: int) -> bytes | None:
    """Batch ``j`` of the stream as a frame, or its error's; None at the stream's end."""
    stages = runtime.Stages(meta(split, j), "iterate")
    try:
        with stages.timed("iterate", "dataset"):  # the iterator's next(): the dataset's own code
            if job.unbatched:  # batch_size=None: each item is a batch, through collate_fn alone
                batch = next(samples, _END)
                if batch is _END:
                    return None
            else:
                # next() on the iterator, as torch's fetcher: not islice, whose iter() would restart a
                # dataset that is its own iterator (and resets itself in __iter__).
                batch = []
                while len(batch) < job.batch_size and (item := next(samples, _END)) is not _END:
                    batch.append(item)
                if not batch or (job.drop_last and len(batch) < job.batch_size):
                    return None
        stages.stage = "state_dict"  # a stream without one is resumed by running it again from its start
        states = (job.dataset.state_dict() if stateful[0] else None,
                  samples.state_dict() if stateful[1] else None)
        with stages.timed("collate", "collate"):
            collated = runtime.collate(job, batch)
        state = b""
        if any(stateful):  # the generators as collate_fn left them: where the next batch draws from
            state = cloudpickle.dumps(_Resumable(states[0], seeding.global_states() if job.keyed else None,
                                                 states[1]))
        stages.stage = "encode"
        parts = wire.encode_parts(collated)
        stages.meta.stream_state = state
        return b"".join(frame_parts(stages.header(), parts))
    except Exception as e:
        return stages.failed(runtime.remote_error(e, stages.stage, process=split["stream"]))


def _replica(dataset: Any) -> bytes:
    """The dataset, pickled for the next epoch; empty where it does not
    pickle (a handle it opened while iterating): the next epoch then starts
    from the job's dataset, as a worker that is not persistent would."""
    try:
        return cloudpickle.dumps(dataset)
    except Exception as e:  # noqa: BLE001 - whatever the user's object raises
        log.warning("the dataset does not pickle after its epoch (%s: %s): the next epoch iterates the job's "
                    "dataset, not this one", type(e).__name__, e)
        return b""


_context: Any = None


def fork_context(temp_dir: str) -> None:
    """Forks this daemon's forkserver now, from the daemon while it runs one thread (torch imported):
    its streams then never wait for a new interpreter's imports (``stream_context`` spawns one
    otherwise, at the first stream). Its socket goes in ``temp_dir``, as stream_context's."""
    stream_context(temp_dir)  # the context, and where its socket goes
    stdlib.fork_forkserver()  # started now, by a fork: stream_context's own would be spawned at the first stream


def stop_context(timeout_s: float = 10.0) -> None:
    """Stops this daemon's forkserver, if it started one, and waits for it (a worker that stops leaves
    no process behind): its streams have ended with their runners."""
    stdlib.stop_forkserver(timeout_s)


def stream_context(temp_dir: str) -> Any:
    """Where stream processes come from: forked from this daemon's forkserver,
    which imported torch once (a stream is a new process every epoch, as
    torch's workers are without persistent_workers; spawning each would
    import torch again, a second and more). Not forked from the daemon
    itself: it runs gRPC threads. The forkserver's socket goes in
    ``temp_dir``, the daemon's own directory, which a later worker removes
    if this one is killed (multiprocessing's own would stay behind)."""
    global _context
    if _context is None:
        stdlib.set_multiprocessing_tempdir(temp_dir)
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", "dpex.worker.stream"])
        _context = context
    return _context
