"""A batch's identity on a worker: its job, consumer, epoch and seq. The
trainer's requests, the runners' batches, the batch process's tasks and every
frame header a worker builds name a batch by it (as Note [A batch's trip] in
dpex/client/fetcher.py follows it)."""
from __future__ import annotations

from typing import Any, NamedTuple

from dpex.worker.budget import Consumer


class Key(NamedTuple):
    """A batch id, ordered as the dispatcher orders splits."""
    epoch: int
    seq: int
    consumer_index: int
    job_id: int

    @property
    def consumer(self) -> Consumer:
        return (self.job_id, self.consumer_index)

    def header(self, **fields: Any) -> Any:
        """The batch's frame header (a ``worker_pb2.Batch``) with ``fields``."""
        from dpex.proto import worker_pb2 as wpb  # the batch process imports it only when it makes one
        return wpb.Batch(job_id=self.job_id, consumer_index=self.consumer_index, epoch=self.epoch, seq=self.seq,
                         **fields)
