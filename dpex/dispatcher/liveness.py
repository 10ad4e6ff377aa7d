"""When the dispatcher last heard from each worker, consumer and job, and
what has gone silent. Clock time lives here, not in the pure state machine."""
from __future__ import annotations

import socket
import time
from typing import Callable, Iterable

from dpex import bottleneck
from dpex.latency import Latencies
from dpex.proto import dispatcher_pb2 as dpb


class Liveness:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._workers: dict[str, float] = {}                 # worker id -> last heartbeat
        self._lost: dict[str, float] = {}                    # worker id -> when it was lost or left
        self._consumers: dict[tuple[int, int], float] = {}   # (job, consumer) -> last sync
        self._released: set[tuple[int, int]] = set()         # (job, consumer)s released for their silence
        self._jobs: dict[int, float] = {}                    # job id -> last call about it
        self.loads: dict[str, dpb.WorkerLoad] = {}           # worker id -> its last reported load
        self._needs: dict[tuple[int, int], tuple[int, float]] = {}  # (job, consumer) -> (workers needed, when)
        # (job, consumer) -> (share of time waiting, batches per second, when), as the trainer last measured
        self._demand: dict[tuple[int, int], tuple[float, float, float]] = {}
        self._verdicts: dict[tuple[int, int], tuple[dpb.Verdict, float]] = {}  # (job, consumer) -> (its last, when)
        self.waits = Latencies()      # by job id: the seconds its trainers waited for each batch, as they reported
        self.consumer_timeouts = 0    # consumers released for their silence

    # ---- heard from ----------------------------------------------------------
    def worker(self, worker_id: str, load: dpb.WorkerLoad | None = None) -> None:
        self._workers[worker_id] = self.clock()
        self._lost.pop(worker_id, None)
        if load is not None:
            self.loads[worker_id] = load

    def consumer(self, job_id: int, consumer: int, workers_needed: int = 0, wait_fraction: float = 0.0,
                 batches_per_s: float = 0.0, verdict: dpb.Verdict | None = None,
                 waits: dpb.Latency | None = None, client_id: int = 0) -> None:
        now = self._consumers[(job_id, consumer)] = self._jobs[job_id] = self.clock()
        if waits is not None and waits.counts:  # the loader's since it began: what grew is added
            self.waits.grew((job_id, consumer, client_id), list(waits.counts), waits.sum_s, str(job_id))
        self._released.discard((job_id, consumer))  # heard of with a plan: whatever fails later is not that
        if workers_needed:
            self._needs[(job_id, consumer)] = (workers_needed, now)
            self._demand[(job_id, consumer)] = (wait_fraction, batches_per_s, now)
        if verdict is not None:
            self._verdicts[(job_id, consumer)] = (verdict, now)

    def verdict(self, job_id: int, max_age_s: float = 60.0) -> dpb.Verdict | None:
        """Where the job's time goes (dpex.bottleneck.of_job): the verdict its consumer that
        waited most reported in the last ``max_age_s``, naming that consumer (``straggler`` when
        its peers hardly wait); None: none reported."""
        now = self.clock()
        recent = {c: v for (j, c), (v, when) in self._verdicts.items() if j == job_id and now - when <= max_age_s}
        if not recent:
            return None
        top, word, reason = bottleneck.of_job([bottleneck.Reported(c, v.wait_fraction, v.bottleneck, v.reason)
                                               for c, v in recent.items()])
        named = dpb.Verdict()
        named.CopyFrom(recent[top.consumer])
        named.consumer_index, named.bottleneck, named.reason = top.consumer, word, reason
        return named

    def demand(self, max_age_s: float = 15.0) -> tuple[int, float, float, int]:
        """What the trainers that measured it in the last ``max_age_s`` said:
        how many, the largest share of time one waited, the batches per second
        they took together, and the most workers one asked for."""
        now = self.clock()
        recent = [(key, d) for key, d in self._demand.items() if now - d[2] <= max_age_s]
        needs = [self._needs[key][0] for key, _ in recent if key in self._needs]
        return (len(recent), max((d[0] for _, d in recent), default=0.0), sum(d[1] for _, d in recent),
                max(needs, default=0))

    def workers_needed(self, job_id: int, max_age_s: float = 60.0) -> int:
        """The most any consumer of the job reported needing in the last ``max_age_s``; 0: none."""
        now = self.clock()
        return max((n for (j, _), (n, when) in self._needs.items() if j == job_id and now - when <= max_age_s),
                   default=0)

    def job(self, job_id: int) -> None:
        self._jobs[job_id] = self.clock()

    # ---- gone ------------------------------------------------------------------
    def lost(self, worker_id: str) -> None:
        """The worker is lost or left: no load shown, forgotten after a grace period."""
        self.loads.pop(worker_id, None)
        self._lost[worker_id] = self.clock()

    def consumer_heard_within(self, job_id: int, consumer: int, seconds: float) -> bool:
        seen = self._consumers.get((job_id, consumer))
        return seen is not None and self.clock() - seen <= seconds

    def released_silent(self, job_id: int, consumer: int) -> None:
        """The reaper released the consumer's plan for its silence: a trainer
        that was only stalled and syncs again is told so (:meth:`was_released`)."""
        self._released.add((job_id, consumer))
        self.consumer_timeouts += 1
        while len(self._released) > 4096:
            self._released.pop()

    def was_released(self, job_id: int, consumer: int) -> bool:
        return (job_id, consumer) in self._released

    def forget_consumer(self, job_id: int, consumer: int) -> None:
        self._consumers.pop((job_id, consumer), None)
        self._needs.pop((job_id, consumer), None)
        self._demand.pop((job_id, consumer), None)
        self._verdicts.pop((job_id, consumer), None)

    def forget_worker(self, worker_id: str) -> None:
        for table in (self._workers, self._lost, self.loads):
            table.pop(worker_id, None)

    def keep_workers(self, worker_ids: Iterable[str]) -> None:
        """Forgets every worker but these (one replaced by a restart on its address)."""
        keep = set(worker_ids)
        for table in (self._workers, self._lost, self.loads):
            for gone in set(table) - keep:
                del table[gone]

    def forget_job(self, job_id: int) -> None:
        self._jobs.pop(job_id, None)
        self.waits.forget(lambda labels: labels != (str(job_id),), lambda reporter: reporter[0] != job_id)
        for table in (self._consumers, self._needs, self._demand):
            for key in [k for k in table if k[0] == job_id]:
                del table[key]

    # ---- what has gone silent -----------------------------------------------------
    def since_heartbeat(self, worker_id: str) -> float:
        return self.clock() - self._workers.get(worker_id, self.clock())

    def silent_workers(self, alive: Iterable[str], timeout_s: float) -> list[str]:
        now = self.clock()
        return [w for w in alive if now - self._workers.get(w, now) > timeout_s]

    def silent_consumers(self, timeout_s: float) -> list[tuple[int, int]]:
        """Consumers silent for ``timeout_s``; each is reported once."""
        now = self.clock()
        silent = [key for key, seen in self._consumers.items() if now - seen > timeout_s]
        for key in silent:
            del self._consumers[key]
        return silent

    def lost_for(self, timeout_s: float) -> list[str]:
        now = self.clock()
        return [w for w, since in self._lost.items() if now - since > timeout_s]

    def idle_jobs(self, job_ids: Iterable[int], timeout_s: float) -> list[int]:
        """Jobs nobody called about for ``timeout_s`` (a job never heard of counts from now)."""
        now = self.clock()
        return [j for j in job_ids if now - self._jobs.setdefault(j, now) > timeout_s]


def unreachable(address: str, timeout_s: float = 1.0) -> str | None:
    """Why nothing accepts TCP connections at ``address`` (HOST:PORT), or None
    when something does. A killed worker's port refuses at once; a frozen or
    merely slow one still accepts (its kernel does), and is left to its
    heartbeat timeout."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
