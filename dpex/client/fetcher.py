"""Fetches one consumer's epoch: routes a request per batch (a credit) to the
worker that owns it, keeps ``window`` batches in flight, drops duplicates and
yields in plan order (or as they come, when unordered).

The trainer's thread only moves bytes it already has; a control thread acks
delivered batches to the dispatcher and long-polls for split owners.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple

import grpc

from dpex import finalizers
from dpex.errors import (DpexCancelledError, DpexConfigError, DpexConnectionError, DpexError, DpexTimeoutError,
                         DpexWireError, rebuild)
from dpex.plan import even
from dpex.plan.even import Count
from dpex.plan.seq import stream_of
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import worker_pb2 as wpb
from dpex.rpc import Outage, call, to_dpex_error
from dpex.client import decode
from dpex.client.checkpoint import Progress
from dpex.client.gate import EvenGate
from dpex.client.seen import DatasetSeen
from dpex.client.ledger import Ledger
from dpex.client.router import Router
from dpex.client.stats import StatsMeter
from dpex.client.streams import Received, StreamPool, drop_file
from dpex.wire.batchkey import EpochKey

log = logging.getLogger("dpex.client")

# Note [A batch's trip]
# Cited from each room it passes (as torch's dataloader.py keeps its notes in one place).
#  1. The trainer: iter(loader) begins an epoch (client/epoch.py); at the first ask it
#     submits the epoch's plan (SubmitPlan, client/job.py), seeds and samplers only.
#  2. The dispatcher (dispatcher/core.py) journals the plan, cut into splits, and hands
#     splits to workers in their heartbeats' answers (dispatcher/polls.py, assignment.py).
#  3. A worker's agent (worker/agent.py) gives each split to the scheduler, which makes it a
#     runner (worker/runners.py); a map split's indices are drawn off its lock
#     (worker/planner.py); picking.py says which batch next; a batch process makes it
#     (worker/runtime.py: dataset, collate_fn, the frame), in place in /dev/shm when large.
#  4. This fetcher's control thread learns each split's owner (SyncConsumer) and the
#     router says whom to ask; the streams (client/streams.py) send a credit per batch on
#     the worker's Fetch stream (worker/service.py); the frame comes back in the gRPC
#     message, on a data socket, or as a /dev/shm path; streams.py parses its header once.
#  5. The ledger (client/ledger.py) puts it in plan order and drops a duplicate;
#     decode.py makes the batch; the loop gets it; its seq is acked with the next sync,
#     and the dispatcher marks it delivered: a batch lost on the way is asked for again,
#     one delivered is never given twice.
#
# Note [Leaving an epoch]
# An epoch left before its end (a break, a peek's iterator dropped, a new iter() on the
# same lane, close()): _Exit, once, whoever comes first (close() or the reaper thread for
# an iterator collected): the control thread stops; streams.end_epoch drops the frames
# queued for it and their hand-off files (never the next epoch's news); ReleaseConsumer
# names the epoch and the iter() that submitted it (its attempt: client/session.py
# releaser). The dispatcher (core.release_consumer) journals the release unless a newer
# epoch is planned or the same epoch was begun again (a release that timed out here may
# land after the new plan: it leaves that plan alone); its splits are released in the
# workers' next heartbeats (agent -> scheduler.release: runners closed, a stream's
# process stopped). A trainer that vanishes instead: its Fetch streams close (the worker's
# scheduler.cancel frees that consumer's ready batches at once) and the dispatcher's
# --consumer-timeout releases it.

_WAIT_LOG_S = 30.0
_EVEN_CHECK_S = 0.25     # at an epoch's end, how long the other consumers' counts are waited for
_MAX_CORRUPT = 3         # corrupt frames from one worker in an epoch before the epoch fails


def describe(error: BaseException | None) -> str:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return str(error)


# A Control's news names its epoch: a lane's results queue outlives an epoch, and a
# left epoch's control thread may still speak (its end is pending) once the next is read.
class _Owners(NamedTuple):
    key: EpochKey
    response: dpb.SyncConsumerResponse


class _Failed(NamedTuple):
    key: EpochKey
    error: DpexError


class _Counts(NamedTuple):  # what the job's consumers told of the epoch's batches (dpex.plan.even)
    key: EpochKey
    counts: list


# A worker's answers to a stream that no retry changes: its loader limit, a wrong key or token.
_REFUSED = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


class Control:
    """Acks delivered batches and learns who owns the rest, off the hot path."""

    def __init__(self, stub: Any, target: str, key: EpochKey,
                 results: queue.SimpleQueue, retry_for_s: float, outage: Outage | None = None,
                 meter: StatsMeter | None = None, client_id: int = 0, job_key: bytes = b"", attempt: int = 0) -> None:
        self._stub, self._target = stub, target
        self._meter = meter or StatsMeter()  # the trainer's measured need and wait, reported with each sync
        self._need = self._meter.recent_need
        self._names = dict(key._asdict(), job_key=job_key, client_id=client_id, attempt=attempt)
        self.key = key
        self._results = results
        self._retry_for_s, self._outage = retry_for_s, outage
        self._lock = threading.Lock()
        self._acks: list[int] = []
        self.next_seq = 0  # the lowest batch not received yet, set by the fetcher
        self.count = Count(0)  # the epoch's batches as far as the fetcher knows, set by it
        self._told = Count(0)  # the count the dispatcher last heard
        self.digest = b""   # the owners last heard
        self.report_past: int | None = None  # another consumer waits for this one to have more
        self._counts_heard: list | None = None
        self._future: grpc.Future | None = None
        self._stop = threading.Event()
        # daemon=True only so that interpreter exit is not blocked before the
        # loader's finalizer runs; that finalizer (close()) is the stop path.
        self._thread = threading.Thread(target=self._run, name="dpex-control", daemon=True)
        self._thread.start()

    def ack(self, seq: int) -> None:
        with self._lock:
            self._acks.append(seq)

    def _track(self, future: grpc.Future) -> None:
        with self._lock:
            self._future = future
            if self._stop.is_set():
                future.cancel()

    def _sync(self, digest: bytes, wait_s: float, cancellable: bool = True, gate: int | None = None,
              rule: str = "") -> dpb.SyncConsumerResponse:
        with self._lock:
            acks, self._acks = self._acks, []
        count = self.count
        waits = self._meter.waits.counts()
        try:
            response = call(self._stub.SyncConsumer,
                        dpb.SyncConsumerRequest(**self._names, delivered_seqs=acks, next_seq=self.next_seq,
                                                owners_digest=digest, wait_s=wait_s,
                                                ready=count.ready, total=count.total, gate=gate, even_batches=rule,
                                                workers_needed=self._need(), verdict=self._meter.recent_verdict(),
                                                waits=dpb.Latency(counts=waits.counts, sum_s=waits.sum_s)
                                                if waits.total else None,
                                                **dict(zip(("wait_fraction", "batches_per_s"),
                                                           self._meter.recent()))),
                        target=self._target, timeout_s=wait_s + 30, retry_for_s=self._retry_for_s,
                        outage=self._outage,
                        stop=None if not cancellable else self._stop.is_set,
                        track=self._track if cancellable else None)
            self._told = count
            return response
        except BaseException:
            with self._lock:  # not delivered to the dispatcher: keep them for the next try
                self._acks[:0] = acks
            raise

    def gate(self, step: int, rule: str, wait_s: float = 1.0) -> None:
        """From the fetcher's thread: syncs until the consumers' counts decide batch ``step`` by
        ``rule`` (or ``wait_s`` passed); the news goes to the results queue, as the thread's."""
        self._heard(self._sync(self.digest, wait_s=wait_s, cancellable=False, gate=step, rule=rule), self.count)

    def _heard(self, response: dpb.SyncConsumerResponse, sent: Count) -> None:
        """A sync's answer: new owners and counts to the fetcher; whether to tell again soon."""
        with self._lock:
            self._heard_locked(response, sent)

    def _heard_locked(self, response: dpb.SyncConsumerResponse, sent: Count) -> None:
        past = response.report_past if response.HasField("report_past") else None
        self.report_past = past if past is not None and sent.total is None and sent.ready <= past else None
        counts = list(response.counts)
        if counts and counts != self._counts_heard:
            self._counts_heard = counts
            self._results.put(_Counts(self.key, counts))
        if response.owners_digest != self.digest:
            self.digest = response.owners_digest
            self._results.put(_Owners(self.key, response))

    def _run(self) -> None:
        while not self._stop.is_set():
            sent = self.count
            try:  # told to tell again soon (another consumer waits on this one's count): short polls
                response = self._sync(self.digest, wait_s=1.0 if self.report_past is None else 0.05)
            except BaseException as e:  # noqa: BLE001 - never end quietly: the epoch fails with the reason
                if not self._stop.is_set():
                    error = e if isinstance(e, DpexError) and not isinstance(e, DpexCancelledError) else \
                        DpexConnectionError(f"the epoch's control stream to {self._target} ended: "
                                            f"{type(e).__name__}: {e}")
                    self._results.put(_Failed(self.key, error))
                return
            self._heard(response, sent)

    def close(self, flush: bool) -> None:
        """Stops the thread; with ``flush``, sends the remaining acks first."""
        self._stop.set()
        with self._lock:
            if self._future is not None:
                self._future.cancel()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        if flush and (self._acks or self._told != self.count):  # and its last count (dpex.plan.even)
            try:
                self._sync(b"", wait_s=0.0, cancellable=False)
            except DpexError as e:
                log.warning("could not report the last delivered batches: %s", e)


# A batch failed in these stages fails every other one of the epoch too
# (torch's DataLoader shuts its workers down after them); in the others
# (__getitem__, collate_fn, ...) the loop may catch it and go on, as in torch.
_FATAL_STAGES = frozenset({"build", "worker_init_fn", "plan", "process"})


class BatchFailed(Exception):
    """next_batch(): batch ``seq`` is the user code's ``error``."""

    def __init__(self, seq: int, error: BaseException) -> None:
        super().__init__(seq, error)
        self.seq, self.error = seq, error


class _Wake(NamedTuple):
    """Put on the results queue to wake a fetcher blocked there (interrupt())."""


class _Exit:
    """What ending an epoch does, once: stop the control thread, and either
    report the last acks (finished) or tell the dispatcher the trainer left
    the epoch, so that workers drop what they hold for it at once. Shared by
    close() and the fetcher's finalizer (an iterator dropped mid-epoch, ended
    by the reaper thread); a second caller waits until the first is done."""

    def __init__(self, control: Control, leave: Callable[[bool], None] | None, streams: StreamPool,
                 key: EpochKey, client_id: int = 0, fetcher: Any = None, attempt: int = 0) -> None:
        self.control, self._leave = control, leave
        self._streams, self.key, self.client_id, self.attempt = streams, key, client_id, attempt
        self.fetcher = weakref.ref(fetcher) if fetcher is not None else lambda: None  # not kept alive here
        self.finished = False
        # The leaving is told before the call returns, but from close() without a reason (the caller's
        # thread returns at once, the release sent): an epoch that another takes the place of (the same
        # epoch, resumed) must be gone before that one is planned.
        self.wait = True
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            try:
                self.control.close(flush=self.finished)
                self._streams.end_epoch(self.key, self.attempt)  # frames queued for it, and their files, go now
                if not self.finished and self._leave is not None:
                    try:
                        self._leave(self.wait)
                    except Exception as e:  # the dispatcher's consumer timeout does it later
                        log.debug("could not release the epoch: %s", e)
            finally:
                _live.discard(self)  # only now: end_left() waits for an end under way


def end_left(key: EpochKey, client_id: int) -> None:
    """Ends now, in this thread, this loader's (``client_id``'s) epoch ``key``
    (job, consumer, epoch) if one is not ended yet, told to the dispatcher
    before this returns: the same epoch planned again (resumed from a state
    dict, or begun again after one taken at an epoch's end) must not be
    released by that one's end, which would come later (its iterator
    dropped: the reaper's; or held in a reference cycle: the collector's).
    Its iterator, if still held, says why at its next batch. Another
    loader's epoch (of the same named job) is not touched: the dispatcher
    refuses the newcomer."""
    for end in [e for e in list(_live) if e.key == key and e.client_id == client_id]:
        fetcher = end.fetcher()
        if fetcher is not None:
            fetcher.close(f"epoch {key.epoch} of job {key.job_id} was begun again by this loader (a state dict loaded), "
                          "which takes this iterator's place")
        end()  # its end may be the reaper's, under way: waited for


class _Reaper:
    """Ends epochs whose iterator was collected, in a thread of its own. The
    garbage collector runs a finalizer in whatever thread it interrupts, also
    inside gRPC while that holds a channel's lock; ending the epoch there
    (gRPC calls on the same channel) deadlocked (found by the differential
    tester: zip(loader, loader) leaves one epoch to the collector).

    The collector may run one inside :meth:`put` itself (making the thread
    allocates): that finalizer puts again, in the same thread, with the lock
    held. Hence a re-entrant lock and a put that stays right when re-entered
    (found by the differential tester's long run: a hang in zip(loader, loader))."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # its put is re-entrant, as a finalizer needs
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._pending = 0

    def put(self, end: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
            self._queue.put(end)
            if self._thread is None:  # a daemon: exit is not held up; drain() is the stop path
                self._thread = self._start_thread()

    def _start_thread(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="dpex-reaper", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        while True:
            try:
                end = self._queue.get(timeout=1.0)
            except queue.Empty:  # idle: the thread ends (a later epoch starts another)
                with self._lock:
                    if not self._pending:
                        self._thread = None
                        return
                continue
            try:
                end()
            except Exception as e:  # noqa: BLE001 - the dispatcher's consumer timeout does it later
                log.debug("could not end a collected epoch: %s", e)
            with self._lock:
                self._pending -= 1

    def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (at exit) for the epochs handed over to be ended."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return
            time.sleep(0.01)


_reaper = _Reaper()
_live: set = set()  # the _Exit of every epoch not ended yet


@finalizers.register_at_exit
def _end_at_exit() -> None:
    """At exit, in this (the main) thread: the epochs still open end, as close() ends them (their
    leaving sent, not waited for: nothing is planned after)."""
    for end in list(_live):
        end.wait = False
        end()
    _reaper.drain()


class EpochFetcher:
    """The iterator of one epoch of one consumer. Closed at its end; dropped
    or closed before (a ``break``, a new ``iter()``), the epoch is left: the
    dispatcher and the workers forget it. The glue of a Ledger (where each
    batch stands), a Router (whom to ask), the streams (dpex.client.streams)
    and the control thread; and the policy for failed streams and corrupt frames."""

    def __init__(self, *, stub: Any, target: str, streams: StreamPool, job_id: int, job_key: bytes = b"",
                 consumer_index: int, epoch: int, num_batches: int, window: int, ordered: bool,
                 timeout_s: float | None, retry_for_s: float, outage: Outage | None = None,
                 dataset: DatasetSeen | None = None, num_streams: int = 0,
                 meter: StatsMeter | None = None, leave: Callable[[bool], None] | None = None,
                 progress: Progress | None = None, report: Callable[[str, str], None] | None = None,
                 client_id: int = 0, health: Callable[[], BaseException | None] | None = None,
                 no_worker_s: float | None = None, num_consumers: int = 1, even_batches: str | None = None,
                 attempt: int = 0, again: int | None = None) -> None:
        """``num_streams`` > 0: an IterableDataset epoch of that many streams
        of unknown length (batch j of stream k is seq j*N+k; num_batches unused).
        ``leave(wait)`` tells the dispatcher the epoch was left unfinished
        (``wait``: before it returns);
        ``report(address, error)`` that a worker's stream broke (a worker found
        gone is marked lost at once, not at its heartbeat timeout).
        ``progress``: the batches the loop was given (it records them); a
        resumed epoch starts with those of its checkpoint, never fetched again.
        ``client_id``: the loader's, which holds the consumer (dpex.dispatcher.claims); ``attempt``: the
        iter()'s that submitted the plan, said with each sync;
        ``job_key``: the job's (dpex.keys), sent with every call on it.
        ``health()``: why the loader's own cluster can serve no more, raised as
        the epoch's error (None: it can); ``no_worker_s``: how long the
        dispatcher may have no live worker before the epoch fails (None: for ever).
        ``num_consumers`` > 1: the job's consumers count their batches (dpex.plan.even);
        ``even_batches`` the rule that makes their epochs equal (None: torch's, and a warning);
        ``again``: under "longest", resumed, the seq of the epoch's first batch (given before the
        checkpoint), fetched again to be repeated, not given."""
        self._streams = streams
        self._results = streams.results
        self._job_key = job_key
        self._dataset = dataset
        self._window = window
        self._group = max(1, window // 4)  # credits go out in groups: one message per group
        self._ordered = ordered
        self._timeout_s = timeout_s
        self._outage, self._target = outage, target
        self.progress = progress or Progress()
        self._ledger: Ledger[tuple[wpb.Batch, Any, int]] = Ledger(num_batches, num_streams, self.progress)
        self._ledger.again = again
        self._router = Router(num_streams)
        self._corrupt: dict[str, int] = {}  # address -> corrupt frames it sent
        self._report = report
        self._health, self._no_worker_s = health, no_worker_s
        self._no_workers_since: float | None = None
        self._meter = meter or StatsMeter()
        self._closed = False
        self._left_why: str | None = None  # why another epoch took this one's place
        self._interrupted = False
        self.key = EpochKey(job_id, consumer_index, epoch)
        self._gate = EvenGate(even_batches, num_consumers, consumer_index, epoch) if num_consumers > 1 else None
        self._held: tuple[wpb.Batch, Any, int] | None = None  # received, waiting for the gate
        self._even_ended = False  # the rule ended the epoch before this consumer's own end
        self._attempt = attempt
        streams.start_epoch(self.key, attempt)  # before the control thread, whose news must find it begun
        self._control = Control(stub, target, self.key, self._results, retry_for_s, outage,
                                self._meter, client_id, job_key, attempt)
        self._control.next_seq = self._ledger.low
        self._control.count = self._own()
        self._exit = _Exit(self._control, leave, streams, self.key, client_id, self, attempt)
        _live.add(self._exit)
        # _end_at_exit ends it at exit, in the main thread
        self._finalizer = finalizers.finalize(self, _reaper.put, self._exit, at_exit=False)

    def __iter__(self) -> "EpochFetcher":
        return self

    @property
    def finished(self) -> bool:
        """Every batch of the epoch was yielded (or as many as even_batches gives)."""
        return self._exit.finished or self._even_ended

    def __len__(self) -> int:
        if self._ledger.num_streams:
            raise TypeError("an IterableDataset epoch has no length")
        return self._ledger.num_batches

    def __next__(self) -> Any:
        asked_at = time.monotonic()
        try:
            batch, nbytes, seq = self.next_batch()
        except StopIteration:
            self.progress.ended = self.finished
            raise
        except BatchFailed as failed:  # given to the loop as its exception: delivered, once
            self.progress.add(failed.seq)
            raise failed.error from None
        self.progress.add(seq)
        self._meter.record(self.key, asked_at, nbytes)
        return batch

    @property
    def next_step(self) -> int:
        """The step (batch) the loop is given next, in plan order."""
        return self._ledger.next if self._ordered else self._ledger.yielded

    def skip(self, steps: range) -> int:
        """Steps (batches) of this epoch that the loop is not to be given, none given yet (a map-style
        epoch): never fetched, acknowledged (delivered once: none is made or given again, after a
        resume too), recorded in the progress a state dict keeps. How many were skipped."""
        ledger = self._ledger
        if ledger.num_streams:
            raise DpexConfigError("an IterableDataset's batches are what its streams yield: none can be skipped "
                                  "by step")
        first = ledger.next if self._ordered else 0
        if steps.step != 1 or steps.start < first or steps.stop > ledger.num_batches:
            raise DpexConfigError(f"steps {steps.start}..{steps.stop - 1} are not all ahead in epoch "
                                  f"{self.key.epoch} (next {first}, of {ledger.num_batches} batches)")
        skipped = 0
        for seq in steps:
            if self.progress.was_given(seq):
                continue
            item = ledger.skip(seq)
            if self._held is not None and self._held[0].seq == seq:
                item, self._held = self._held, None
            if item is not None:
                drop_file(item[0])
            self.progress.add(seq)
            self._control.ack(seq)
            skipped += 1
        self._control.next_seq = ledger.low
        return skipped

    def interrupt(self) -> None:
        """From another thread: makes a blocked next_batch() stop (StopIteration)."""
        self._interrupted = True
        self._results.put(_Wake())

    def next_batch(self) -> tuple[Any, int, int]:
        """The next batch, the bytes it took on the wire and its seq; not metered."""
        if self._closed:
            if self._left_why is not None:
                raise DpexCancelledError(self._left_why)
            raise StopIteration
        last_progress = last_log = time.monotonic()
        while True:
            if self._interrupted:
                raise StopIteration
            item = self._held = self._held or self._ledger.pop_ready(self._ordered)  # its own until given
            if self._gate is not None and self._gate.rule is not None and (item is not None or self._ledger.finished):
                verdict = self._even(item is not None)
                if verdict is None:  # the others' counts do not decide it yet: a sync that waits for them
                    self._wait_gate(last_progress)
                    continue
                if verdict == even.END:
                    self._end_evenly(item)
                if item is None and (self._gate.has_first or self._ledger.again is None):
                    return self._repeat()  # "longest": this consumer's own ran out, another's go on
                # (else its first batch, fetched again after a resume, is on its way)
            self._held = None
            if item is not None:
                return self._finish(item)
            if self._ledger.finished and self._ledger.again is None:
                if self._gate is not None and self._gate.rule is None:
                    self._check_even()
                self._exit.finished = True
                self.close()
                raise StopIteration
            self._send(self._ledger.asks(self._window, self._group, self._ordered, self._router.route))
            try:
                got = self._results.get(timeout=1.0)
            except queue.Empty:
                got = None
            if got is not None and self._handle(got):
                last_progress = time.monotonic()
                continue
            # No batch (a second without news, or news that brought none: failing streams
            # come every backoff): the epoch may be stuck.
            now = time.monotonic()
            self._check_stuck(now, last_progress)
            if now - last_log > _WAIT_LOG_S:
                last_log = now
                log.warning("%s", self._waiting_for("still waiting"))

    def _check_stuck(self, now: float, last_progress: float) -> None:
        """Ends the epoch with an error that says why when no batch can come:
        none arrived for ``timeout``, the embedded cluster failed (``health``),
        or no worker has been alive for ``no_worker_s`` (None: ``timeout``)."""
        error = self._health() if self._health is not None else None
        if error is not None:
            self.close()
            raise error
        if self._timeout_s is not None and now - last_progress > self._timeout_s:
            self.close()
            since = self._outage.since if self._outage is not None else None
            if since is not None:  # the cause: the dispatcher is down (its outage had as long)
                raise DpexConnectionError(self._waiting_for(
                    f"no batch arrived for {self._timeout_s:g}s and {self._target} has been unreachable "
                    f"for {now - since:.0f}s"))
            raise DpexTimeoutError(self._waiting_for(f"no batch arrived for {self._timeout_s:g}s"))
        if self._router.workers_alive != 0:
            self._no_workers_since = None
            return
        if self._no_workers_since is None:
            self._no_workers_since = now
        elif self._no_worker_s is not None and now - self._no_workers_since > self._no_worker_s:
            self.close()
            raise DpexConnectionError(self._waiting_for(
                f"{self._target} has had no live worker for {now - self._no_workers_since:.0f}s (start "
                "dpex-worker --dispatcher HOST:PORT on the nodes with the data)"))

    # ---- even_batches (dpex.plan.even, dpex.client.gate) ------------------------------
    def _own(self) -> Count:
        """This consumer's batches of the epoch: at least those given and received; all, once known."""
        ledger = self._ledger
        total = ledger.total()
        if total is not None:
            return Count(total, total)
        return Count(ledger.yielded + len(ledger.received) + (self._held is not None))

    @property
    def _step(self) -> int:
        """The number of the batch to give next (this consumer's own and repeats)."""
        return self._ledger.yielded + self.progress.repeats

    def _even(self, own_batch: bool) -> str | None:
        assert self._gate is not None
        if self._gate.rule == even.LONGEST and own_batch:
            return even.GO
        return self._gate.decide(self._step, self._own())

    def _check_even(self) -> None:
        """Without even_batches, at the epoch's end: whether another consumer has more batches
        (a DDP rank that would wait in an all-reduce for ever), warned once. Asked as a
        "longest" gate past this one's last batch, waited for briefly (the others told at once)."""
        assert self._gate is not None
        own = self._control.count = self._own()
        try:
            self._control.gate(self._step, even.LONGEST, wait_s=_EVEN_CHECK_S)
        except DpexError as e:
            log.debug("could not compare the epoch's counts: %s", e)
            return
        self._drain()
        self._gate.check(own)

    def _drain(self) -> None:
        """The results queue's news, taken now (after a sync of this thread's)."""
        while True:
            try:
                got = self._results.get_nowait()
            except queue.Empty:
                return
            self._handle(got)

    def _wait_gate(self, last_progress: float) -> None:
        """One sync that waits (a second at most) for the counts to decide the next batch."""
        assert self._gate is not None and self._gate.rule is not None
        self._control.count = self._own()
        try:
            self._control.gate(self._step, self._gate.rule)
        except DpexError:
            self.close()
            raise
        self._drain()
        now = time.monotonic()
        if self._timeout_s is not None and now - last_progress > self._timeout_s:
            self.close()
            waited = ", ".join(map(str, self._gate.waited_on(self._step, self._own())))
            raise DpexTimeoutError(
                f"job {self.key.job_id} consumer {self.key.consumer_index} epoch {self.key.epoch}: waited "
                f"{self._timeout_s:g}s at batch {self._step} for consumer(s) {waited or '?'} of the job to say "
                f"whether they have one (even_batches={self._gate.rule!r}): is that rank running?")

    def _end_evenly(self, item: tuple[wpb.Batch, Any, int] | None) -> None:
        """The rule ended the epoch here: this consumer's batches past it are dropped (counted)."""
        own = self._own()
        dropped = own.ready - self._ledger.yielded  # at least; with its end unknown, the rest are not made
        self._held = None
        if item is not None:
            drop_file(item[0])
        if dropped > 0:
            log.info("even_batches=%r: epoch %d ends at %d batches; %d of consumer %d's own dropped",
                     self._gate.rule if self._gate else None, self.key.epoch, self._step, dropped,
                     self.key.consumer_index)
            self._meter.evened(dropped=dropped)
        if self._ledger.finished:
            self._exit.finished = True
        else:
            self._even_ended = True
        self.close()
        raise StopIteration

    def _repeat(self) -> tuple[Any, int, int]:
        """"longest": the epoch's first batch again, for a consumer whose own ran out."""
        assert self._gate is not None
        if not self._gate.has_first:
            try:  # its count told first: the others end their epoch at theirs
                self._control.gate(self._step, even.LONGEST, wait_s=0.0)
            except DpexError as e:
                log.debug("could not tell the epoch's count: %s", e)
            self.close()
            if self._ledger.resumed:  # an IterableDataset's stream, resumed: its first batch is not made again
                raise DpexConfigError(
                    f"consumer {self.key.consumer_index} of job {self.key.job_id} was resumed in epoch "
                    f"{self.key.epoch} past its own batches, and an IterableDataset's stream cannot make its first "
                    "batch again to repeat (even_batches='longest'): checkpoint before a rank's own batches run "
                    "out, or use even_batches='shortest'")
            raise DpexConfigError(
                f"consumer {self.key.consumer_index} of job {self.key.job_id} has no batch of its own in epoch "
                f"{self.key.epoch} to repeat while others go on (even_batches='longest' repeats a rank's own "
                "first batch): give every rank data, or even_batches='shortest'")
        self._meter.evened(repeated=1)
        return self._gate.first, 0, -1

    # ---- internals ------------------------------------------------------------
    def _waiting_for(self, what: str) -> str:
        missing = self._ledger.missing()
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        alive = self._router.workers_alive
        return (f"job {self.key.job_id} consumer {self.key.consumer_index} epoch {self.key.epoch}: {what}; "
                f"{len(missing)} batches missing (seq {shown}); "
                f"workers alive: {alive if alive >= 0 else 'unknown'}")

    def _finish(self, item: tuple[wpb.Batch, Any, int]) -> tuple[Any, int, int]:
        meta, batch, nbytes = item
        self._ledger.given(meta.seq, self._ordered)
        self._control.count = self._own()
        if meta.stream_state:  # the dataset's own state after this batch, for a checkpoint
            self.progress.offer(meta.seq, meta.stream_state)
        if meta.HasField("error"):
            error = rebuild(meta.error, batch=f"{self.key.epoch}/{self.key.consumer_index}/{meta.seq}")
            if meta.error.stage in _FATAL_STAGES:
                self.close()
            raise BatchFailed(meta.seq, error)
        if self._gate is not None:
            self._gate.given(batch)
        return batch, nbytes, meta.seq

    def _send(self, asks: dict[str, list[int]]) -> None:
        """One request per worker, naming every batch asked of it."""
        for address, seqs in asks.items():
            self._streams.send(address, wpb.FetchRequest(
                job_id=self.key.job_id, job_key=self._job_key, consumer_index=self.key.consumer_index, epoch=self.key.epoch,
                seq=seqs[0], more_seqs=seqs[1:], attempt=self._attempt))

    def _handle(self, got: Any) -> bool:
        """Takes one result; True when a new batch arrived."""
        ledger = self._ledger
        if isinstance(got, (_Owners, _Failed, _Counts)) and got.key != self.key:
            return False  # an earlier epoch's on this lane, ended after this one began
        if isinstance(got, _Counts):
            if self._gate is not None:
                self._gate.told(got.counts, self._own())
            return False
        if isinstance(got, _Owners):
            self._router.update(got.response)
            self._meter.workers_alive = self._router.workers_alive
            # A request to a worker that no longer owns the batch (lost, maybe
            # frozen with its connection still open) will not be answered.
            ledger.reroute(lambda seq, address: self._router.owner(seq) != address)
            return False
        if isinstance(got, _Failed):
            self.close()
            raise got.error
        if isinstance(got, _Wake):
            return False
        assert isinstance(got, Received)
        if got.frame is None:
            if isinstance(got.error, grpc.RpcError) and got.error.code() in _REFUSED:
                self.close()  # the worker refused this loader (its --max-loaders, a key): asking again would not help
                raise to_dpex_error(got.error, f"worker {got.address}") from None
            failures = self._router.stream_failed(got.address)
            if failures % 10 == 1:  # a dead worker fails every backoff until the dispatcher notices
                log.warning("stream to worker %s failed (%s, %d times); asking for its batches again",
                            got.address, describe(got.error), failures)
                if self._report is not None:
                    self._report(got.address, describe(got.error))
            self._restart_stream(got.address)
            return False
        if got.meta is None:  # it did not parse (dpex.client.streams parsed it)
            return self._corrupt_frame(got.address, None, got.error)
        meta, payload = got.meta, got.payload
        if EpochKey.of(meta) != self.key or (meta.attempt and meta.attempt != self._attempt):
            drop_file(meta)
            return False  # from an earlier epoch or loader, or this epoch's earlier attempt
        seq = meta.seq
        if meta.not_assigned:
            # Not from that worker until the dispatcher names an owner; the same
            # worker is asked again after a failed stream (it may be a blip).
            if ledger.ask_again(seq, got.address):
                self._router.forget(seq, got.address)
            return False
        if meta.end_of_stream and ledger.num_streams:
            ledger.end_stream(*stream_of(seq, ledger.num_streams))
            if meta.stream_state:  # its dataset as the epoch left it (a job that keeps its dataset)
                self.progress.carry(stream_of(seq, ledger.num_streams)[0], meta.stream_state)
            self._control.next_seq = ledger.low
            self._control.count = self._own()
            return True
        again = seq == ledger.again  # "longest", resumed: the epoch's first batch, to repeat
        if not again and not ledger.is_new(seq):
            drop_file(meta)
            return False  # a duplicate (e.g. re-sent after a reconnect)
        begun = time.perf_counter()
        if meta.shm_path:  # a same-host worker's hand-off file: map it, no copy
            try:
                meta, payload = decode.mapped(meta)
            except PermissionError as e:  # another user's worker: from now on, bytes over gRPC
                log.warning("cannot map %s (%s); receiving batches over gRPC instead", meta.shm_path, e)
                self._streams.host = ""
                self._restart_stream(got.address)
                return False
            except FileNotFoundError:  # its worker died and a successor cleaned up: ask again
                ledger.ask_again(seq, got.address)
                return False
            except (OSError, DpexWireError) as e:
                return self._corrupt_frame(got.address, seq, DpexWireError(f"hand-off file: {e}"))
        # A worker that does not say (older, or an IterableDataset stream) is not checked.
        if self._dataset is not None and meta.HasField("dataset_length"):
            try:
                self._dataset.check(meta.job_id, got.address, meta.dataset_length, meta.dataset_fingerprint)
            except DpexConfigError:
                self.close()
                raise
        batch, size = None, len(payload)  # bytes received, compressed or not
        if not meta.HasField("error"):
            try:
                batch = decode.batch(meta, payload)
            except DpexWireError as e:
                return self._corrupt_frame(got.address, seq, e)
        self._meter.received(got.address, meta.stages if meta.HasField("stages") else None, got.receive_s,
                             time.perf_counter() - begun, meta.processes)
        if again:
            ledger.again = None
            ledger.requested.pop(seq, None)
            if self._gate is not None and not meta.HasField("error"):
                self._gate.given(batch)
            self._control.ack(seq)
            return False
        ledger.receive(seq, (meta, batch, size))
        self._control.ack(seq)
        self._control.next_seq = ledger.low
        self._control.count = self._own()
        return True

    def _corrupt_frame(self, address: str, seq: int | None, error: DpexWireError) -> bool:
        """A frame that does not decode: ask again (the worker produces the
        batch anew), up to _MAX_CORRUPT times per worker, then fail the epoch."""
        count = self._corrupt[address] = self._corrupt.get(address, 0) + 1
        what = f"batch {seq}" if seq is not None else "a frame"
        if count >= _MAX_CORRUPT:
            self.close()
            raise DpexWireError(f"worker {address} sent {count} corrupt batch frames in epoch {self.key.epoch} "
                                f"of job {self.key.job_id} (last: {what}: {error})")
        log.warning("worker %s sent a corrupt frame (%s: %s); asking for it again", address, what, error)
        if seq is None:  # which batch it was is unknown: ask again for all that worker owes us
            self._restart_stream(address)
        else:
            self._ledger.ask_again(seq, address)
        return False

    def _restart_stream(self, address: str) -> None:
        """Closes the stream to a worker and asks again for all it owed us
        (over a new stream, once its backoff, if any, is over)."""
        self._streams.drop(address)
        self._ledger.reroute(lambda seq, owed_by: owed_by == address)

    @property
    def closed(self) -> bool:
        """Ended: finished, left, or failed."""
        return self._closed

    def close(self, why: str | None = None) -> None:
        """Ends the epoch; before its last batch, that is leaving it. With
        ``why`` (another epoch took its place), its next batch raises that."""
        if why is not None and not self._closed:
            self._left_why = why
        elif not self._closed:
            self._exit.wait = False  # the caller's thread goes on; the leaving is sent
        self._closed = True
        if self._finalizer.detach() is not None:  # by the caller, in its thread: ended before close() returns
            self._exit()
