"""A worker daemon in this process: its batch processes, forked first where
that is safe, then the server, served until SIGTERM or SIGINT. ``dpex-worker``
and the embedded worker forked from a trainer (dpex.launch.forked) both run it."""
from __future__ import annotations

import sys
import types

from dpex.config import WorkerConfig
from dpex.daemon import can_fork, serve_until_signalled
from dpex.worker.pool import BatchPool


def leave_main() -> None:
    """This process's ``__main__`` (``dpex-worker``'s own module, or the
    trainer's script for the embedded worker) would be run again by
    multiprocessing in every process the daemon starts by forkserver or
    spawn (each stream's, a batch process started again): each would pay
    its imports (0.15 s a stream for dpex-worker's), and a script without
    a main guard would build its loader there. What a worker needs of a
    script comes by value, in its jobs."""
    sys.modules["__main__"] = sys.modules["__mp_main__"] = types.ModuleType("__main__")


def forked_pool(config: WorkerConfig) -> BatchPool | None:
    """The batch processes, forked now, before this daemon runs any thread,
    from a process that has imported torch (which it needs anyway, to draw
    torch's samplers): none of them imports torch again, as torch's
    DataLoader forks its workers. None where forking is not safe here: the
    server then spawns them."""
    from dpex.worker.server import check_code_source, check_data_paths
    check_code_source(config)  # a worker that would refuse to start forks nothing
    check_data_paths(config.data_paths)
    if not can_fork():
        return None
    import torch  # noqa: F401 - what the forked processes inherit
    return BatchPool(config.processes, shared_memory=config.shared_memory, handoff_min_bytes=config.shm_min_bytes,
                     fork=True, in_turn=config.in_turn,
                     sample_budgets=(config.sample_cache_bytes, config.sample_disk_bytes))


def run(config: WorkerConfig, pool: BatchPool | None, ready_file: str | None) -> None:
    """Serves a worker of ``config`` (with ``pool``, or processes it spawns)
    until SIGTERM or SIGINT, writing ``ready_file`` once it serves. A worker
    that cannot start raises, its pool closed."""
    leave_main()  # before the server, which starts streams' processes (and a spawned pool's)
    from dpex.worker.server import WorkerServer
    try:
        server = WorkerServer(config, pool=pool)
    except BaseException:
        if pool is not None:  # its processes go too (closing twice is nothing)
            pool.close()
        raise
    serve_until_signalled(server, ready_file)
