"""Which loader holds each consumer of a job: one loader per consumer stream.

A loader (a random ``client_id`` per RemoteDataLoader) claims consumer k of a
job with its plans and syncs. Another loader's plan for that consumer is
refused while the holder is mid-epoch and still syncing (a live loader syncs
at least every second), instead of silently taking the epoch from it. The
claim goes when its holder releases the consumer or its long poll is
cancelled (its connection ended: a dead process, when the server sees it),
and counts for nothing after HELD_S without a call from its holder; a resumed
epoch (a loader restarted from a checkpoint) takes the consumer over.
Kept in memory: after a dispatcher restart loaders claim their consumers again
with their next call."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from dpex.config import CLAIM_HELD_S as HELD_S  # a holder that synced this recently is alive
from dpex.errors import CONSUMER_IN_USE, DpexConflictError


@dataclass(frozen=True)
class Claim:
    client_id: int
    peer: str
    since: float  # wall-clock time it was claimed


class Claims:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._held: dict[tuple[int, int], Claim] = {}

    def take(self, key: tuple[int, int], client_id: int, peer: str, job_name: str, busy: bool,
             takeover: bool = False) -> None:
        """Claims consumer ``key`` = (job, consumer) for ``client_id``. Refused
        while another loader holds it and it is ``busy`` (mid-epoch and syncing),
        unless ``takeover`` (a resumed epoch). ``client_id`` 0 is an id as any
        other (no bypass: a forged call with 0 stalled or cancelled a trainer's epoch)."""
        claim = self._held.get(key)
        if claim is not None and claim.client_id == client_id:
            return
        if claim is not None and busy and not takeover:
            name = f"job {job_name!r}" if job_name else f"job {key[0]}"
            raise DpexConflictError(
                f"consumer {key[1]} of {name} {CONSUMER_IN_USE} ({claim.peer}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(claim.since))}); two loaders never share "
                "one consumer's stream: give this one another consumer_index (with num_consumers), another "
                "job_name, or close the other")
        self._held[key] = Claim(client_id, peer, self._clock())

    def gone(self, key: tuple[int, int], client_id: int) -> bool:
        """The holder's connection ended (its long poll was cancelled: a dead
        process, or a loader leaving): the consumer is free for another at once
        (the holder, if alive, claims it again with its next call). Whether it held it."""
        if client_id and self._held.get(key, Claim(0, "", 0.0)).client_id == client_id:
            del self._held[key]
            return True
        return False

    def holds(self, key: tuple[int, int], client_id: int) -> bool:
        """Whether ``client_id`` may act for consumer ``key`` (it holds it, or nobody does)."""
        claim = self._held.get(key)
        return claim is None or claim.client_id == client_id

    def release(self, key: tuple[int, int], client_id: int) -> None:
        if self.holds(key, client_id):
            self._held.pop(key, None)

    def forget_job(self, job_id: int) -> None:
        """Drops the claims of a collected job."""
        for key in [k for k in self._held if k[0] == job_id]:
            del self._held[key]
