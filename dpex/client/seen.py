"""The dataset a loader plans for: the trainer's own instance, or the one
every live worker builds from its local files, which must all agree."""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple

import torch.utils.data as tud

from dpex.dataset import describe_dataset
from dpex.errors import DpexConfigError, DpexConnectionError, rebuild
from dpex.proto import worker_pb2 as wpb
from dpex.proto import worker_pb2_grpc as wgrpc
from dpex.rpc import call, channel

log = logging.getLogger("dpex.client")


class DatasetSeen(NamedTuple):
    """The dataset the plan was made for: who built it, its length and fingerprint."""
    where: str
    length: int
    fingerprint: str
    iterable: bool = False

    def check(self, job_id: int, address: str, length: int, fingerprint: str) -> None:
        """Worker ``address``'s copy must agree: else its data is not what was planned."""
        if (length, fingerprint) != (self.length, self.fingerprint):
            what = [f"{self.where} has {self.length} samples", f"worker {address} has {length}"]
            if fingerprint != self.fingerprint:
                what = [f"{what[0]} (fingerprint {self.fingerprint!r})", f"{what[1]} (fingerprint {fingerprint!r})"]
            raise DpexConfigError(f"workers disagree about the dataset of job {job_id}: {what[0]}, "
                                  f"{what[1]}; every worker needs the same data (the plan was made for "
                                  f"{self.length} samples)")


def in_trainer(dataset: Any) -> DatasetSeen:
    """A dataset instance the trainer holds (and ships to the workers)."""
    length, fingerprint = describe_dataset(dataset)
    return DatasetSeen("the trainer's dataset instance", length, fingerprint, isinstance(dataset, tud.IterableDataset))


def on_workers(alive: Callable[[], list[str]], job_id: int, job_key: bytes, token: str | None, tls_ca: bytes | None,
               wait_s: float, target: str, timeout_s: float | None = None) -> DatasetSeen:
    """Asks every live worker (``alive()``: their addresses) to build the
    job's dataset, in parallel: its length (-1: none), its fingerprint, and
    whether it is an IterableDataset. Workers whose copies disagree are an
    error now; one that joins later is checked by its first batch. Waits up
    to ``wait_s`` for a first worker, and ``timeout_s`` (the loader's
    ``timeout``; None: 300 s) for a worker's answer."""
    def one(address: str) -> wpb.InspectResponse | None:
        try:
            ch = channel(address, token, tls_ca)
            try:
                return call(wgrpc.WorkerStub(ch).Inspect, wpb.InspectRequest(job_id=job_id, job_key=job_key),
                            target=f"worker {address}", timeout_s=300 if timeout_s is None else timeout_s)
            finally:
                ch.close()
        except DpexConnectionError as e:
            log.warning("%s; asking the other workers", e)
            return None

    deadline = time.monotonic() + wait_s
    while True:
        addresses = alive()
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(addresses)))) as threads:
            answers = list(threads.map(one, addresses))
        seen = None
        for address, response in zip(addresses, answers):
            if response is None:
                continue
            if response.HasField("error"):
                raise rebuild(response.error)
            this = DatasetSeen(f"worker {address}", response.length, response.fingerprint, response.iterable)
            if seen is None:
                seen = this
            else:
                seen.check(job_id, address, this.length, this.fingerprint)
        if seen is not None:
            return seen
        if time.monotonic() > deadline:
            raise DpexConnectionError(f"no worker is registered with {target} (waited {wait_s:g}s)")
        time.sleep(0.2)
