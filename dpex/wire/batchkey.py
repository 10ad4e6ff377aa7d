"""A batch's identity and its epoch's, on both sides of the wire: a job's
consumer's epoch (``EpochKey``) and a batch in it (``Key``). The trainer's
requests, a worker's runners, its batch processes' tasks and every frame header
name a batch by them (as Note [A batch's trip] in dpex/client/fetcher.py
follows it); the trainer takes a frame for the epoch it fetches by its header's
``EpochKey``."""
from __future__ import annotations

from typing import Any, NamedTuple


class EpochKey(NamedTuple):
    """One consumer's epoch of a job: what a trainer's fetcher fetches, what a
    worker's stream and batch-process lane serve."""
    job_id: int
    consumer_index: int
    epoch: int

    @classmethod
    def of(cls, meta: Any) -> "EpochKey":
        """The epoch a frame header (a ``worker_pb2.Batch``) names."""
        return cls(meta.job_id, meta.consumer_index, meta.epoch)


class Key(NamedTuple):
    """A batch id, ordered as the dispatcher orders splits. ``attempt``: the plan's
    (the iter() that submitted it): the same loader's epoch begun again is another
    plan, maybe of other batches under the same numbers (0: not said)."""
    epoch: int
    seq: int
    consumer_index: int
    job_id: int
    attempt: int = 0

    @property
    def consumer(self) -> tuple[int, int]:
        """(job_id, consumer_index), as dpex.worker.budget's ``Consumer``."""
        return (self.job_id, self.consumer_index)

    @property
    def epoch_key(self) -> EpochKey:
        return EpochKey(self.job_id, self.consumer_index, self.epoch)

    def header(self, **fields: Any) -> Any:
        """The batch's frame header (a ``worker_pb2.Batch``) with ``fields``."""
        from dpex.proto import worker_pb2 as wpb  # the batch process imports it only when it makes one
        return wpb.Batch(job_id=self.job_id, consumer_index=self.consumer_index, epoch=self.epoch, seq=self.seq,
                         attempt=self.attempt, **fields)
