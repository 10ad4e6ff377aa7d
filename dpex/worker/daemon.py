"""A worker daemon in this process: its batch processes and its streams'
forkserver, forked first where that is safe, then the server, served until
SIGTERM or SIGINT. ``dpex-worker`` and the embedded worker forked from a
trainer (dpex.launch.forked) both run it."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Callable

from dpex.config import WorkerConfig
from dpex.daemon import can_fork, serve_until_signalled
from dpex.procutil import temp_dir
from dpex.worker.pool import BatchPool


@dataclass(frozen=True)
class Forked:
    """What a worker forks while it runs one thread, with torch imported: its batch processes, and the
    forkserver of its streams (in its directory ``job_dir``)."""
    pool: BatchPool
    job_dir: str


def fork_first(make_pool: Callable[[], BatchPool]) -> Forked:
    """``make_pool()``'s processes, then the worker's directory and its streams' forkserver, forked now:
    no batch or stream process imports torch again, as torch's DataLoader forks its workers (a spawned
    forkserver would, at the first stream of an IterableDataset). The forkserver last: the batch
    processes hold none of its pipe (it ends when the worker closes it), and it closes theirs."""
    from dpex.worker import stream
    leave_main()  # the forkserver's children have the empty __main__ too
    pool = make_pool()
    try:
        job_dir = temp_dir("worker")  # named by pid: a later worker removes it if we are killed
        stream.fork_context(job_dir)
    except BaseException:
        pool.close()
        raise
    return Forked(pool, job_dir)


def leave_main() -> None:
    """This process's ``__main__`` (``dpex-worker``'s own module, or the
    trainer's script for the embedded worker) would be run again by
    multiprocessing in every process the daemon starts by forkserver or
    spawn (each stream's, a batch process started again): each would pay
    its imports (0.15 s a stream for dpex-worker's), and a script without
    a main guard would build its loader there. What a worker needs of a
    script comes by value, in its jobs."""
    sys.modules["__main__"] = sys.modules["__mp_main__"] = types.ModuleType("__main__")


def forked_pool(config: WorkerConfig) -> Forked | None:
    """The batch processes and the streams' forkserver (:func:`fork_first`), forked now, before this
    daemon runs any thread, from a process that has imported torch (which it needs anyway, to draw
    torch's samplers). None where forking is not safe here: the server then spawns them."""
    from dpex.worker.server import check_code_source, check_data_paths
    check_code_source(config)  # a worker that would refuse to start forks nothing
    check_data_paths(config.data_paths)
    if not can_fork():
        return None
    import torch  # noqa: F401 - what the forked processes inherit
    return fork_first(lambda: BatchPool(
        config.processes, shared_memory=config.shared_memory, handoff_min_bytes=config.shm_min_bytes, fork=True,
        in_turn=config.in_turn, sample_budgets=(config.sample_cache_bytes, config.sample_disk_bytes)))


def run(config: WorkerConfig, forked: Forked | None, ready_file: str | None) -> None:
    """Serves a worker of ``config`` (with what it ``forked``, or processes it spawns)
    until SIGTERM or SIGINT, writing ``ready_file`` once it serves. A worker
    that cannot start raises, its pool closed."""
    leave_main()  # before the server, which starts streams' processes (and a spawned pool's)
    from dpex.worker.server import WorkerServer
    try:
        server = WorkerServer(config, pool=forked and forked.pool, job_dir=forked and forked.job_dir)
    except BaseException:
        if forked is not None:  # its processes go too (closing twice is nothing)
            forked.pool.close()
        raise
    serve_until_signalled(server, ready_file)
