"""The torch.distributed run a trainer belongs to: its rank and world size,
and the one job name its ranks share (so that DDP needs no ``job_name``)."""
from __future__ import annotations

import hashlib
import logging
import os
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta

log = logging.getLogger("dpex.client")

_STORE_KEY = "dpex/run-nonce"
_lock = threading.Lock()
_nonce: list[str] = []           # this run's nonce, once agreed
_counts: dict[str, int] = {}     # loaders of one definition made so far in this process


@dataclass(frozen=True)
class Run:
    """A torch.distributed run: this process is ``rank`` of ``world_size``."""
    rank: int
    world_size: int
    identity: str  # the same in every rank of the run, different in another run


def current_run(wait_s: float = 30.0) -> Run | None:
    """The run this process is a rank of: an initialised process group, or
    torchrun's environment (RANK, WORLD_SIZE); None outside one."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return Run(dist.get_rank(), dist.get_world_size(), _store_nonce(dist.get_rank(), wait_s))
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    parts = [os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT",
                                             "WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT")]
    if os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]:
        parts.append(str(os.getppid()))  # one node: the ranks share their launcher, another run has another
    return Run(rank, world, "|".join(parts))


def _store_nonce(rank: int, wait_s: float) -> str:
    """A nonce rank 0 puts in the process group's store, read by every rank:
    unique to this run even where torchrun's run id is the default ("none")."""
    with _lock:
        if _nonce:
            return _nonce[0]
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            store = _get_default_store()
            if rank == 0:
                store.set(_STORE_KEY, uuid.uuid4().hex)
            store.wait([_STORE_KEY], timedelta(seconds=wait_s))
            _nonce.append(store.get(_STORE_KEY).decode())
        except Exception as e:  # no store to share (a backend without one): the environment
            log.debug("no process-group store (%s); using the environment", e)
            _nonce.append("|".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR",
                                                                      "MASTER_PORT", "WORLD_SIZE")))
        return _nonce[0]


def shared_job_name(run: Run, definition: bytes) -> str:
    """The job name of the n-th loader with this definition in this run; the
    ranks build their loaders in the same order, so they meet in one job."""
    digest = hashlib.sha256(definition).hexdigest()[:12]
    with _lock:
        n = _counts.get(digest, 0)
        _counts[digest] = n + 1
    run_id = hashlib.sha256(run.identity.encode()).hexdigest()[:12]
    return f"ddp-{run_id}-{digest}-{n}"
