"""The dispatcher's durable state: a snapshot plus the log written after it.

``recover`` reads the snapshot (if any) and replays the log that follows it;
``append`` writes an update before it takes effect; once the log has
grown past ``compact_bytes`` and twice the last snapshot, or past half the
snapshot when an epoch plan ends, ``compact`` writes a new snapshot and
starts a new log, so that restart time and disk use follow the live state,
not the history. A compaction survives a kill at any point:

1. the snapshot is written to ``snapshot.tmp``, fsync'd, renamed over
   ``snapshot`` and the directory fsync'd: the new snapshot names generation
   g+1, whose log (``journal-<g+1>.log``) may not exist yet (empty);
2. the new log is created (and the directory fsync'd), appends go there;
3. the old log is deleted. A restart deletes logs of other generations.
A kill before the rename leaves the old snapshot and its whole log.

Durability is a group commit, as databases do it: ``append`` writes to the
OS (a killed dispatcher loses nothing) and a thread of the store fsyncs
whatever was appended since its last fsync, one fsync for a group of
records. The service answers a call only once everything appended before
the answer is durable (:meth:`Store.settle`), so no answer reveals a state
that a crash of the machine could take back, and a fleet's updates cost a
few fsyncs a second instead of one each on the server's event loop.
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import struct
import threading
import time
import zlib
from typing import Callable, NoReturn

from dpex.dispatcher import snapshot
from dpex.dispatcher.journal import Journal, fsync_dir
from dpex.dispatcher.state import DispatcherState
from dpex.errors import DpexConfigError, DpexConnectionError, DpexError
from dpex.latency import Latencies
from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")

SNAPSHOT = "snapshot"
_MIN_LOG = 256  # bytes; a shorter log is never worth a snapshot
_HEADER = struct.Struct("<II")
_LOG = re.compile(r"journal(?:-(\d+))?\.log$")


def log_name(generation: int) -> str:
    return "journal.log" if generation == 0 else f"journal-{generation}.log"


def read_snapshot(work_dir: str) -> jpb.Snapshot | None:
    try:
        with open(os.path.join(work_dir, SNAPSHOT), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    if len(data) >= _HEADER.size:
        length, crc = _HEADER.unpack_from(data)
        body = data[_HEADER.size:_HEADER.size + length]
        if len(body) == length and zlib.crc32(body) == crc:
            return jpb.Snapshot.FromString(body)
    # Written to a temporary file and renamed: a torn one means the disk lies.
    raise DpexConfigError(f"the snapshot {os.path.join(work_dir, SNAPSHOT)} is corrupt; "
                          "move the work dir aside to start with no state")


class Store:
    def __init__(self, work_dir: str, compact_bytes: int = 256 << 10) -> None:
        os.makedirs(work_dir, exist_ok=True)
        self.work_dir = work_dir
        self.compact_bytes = compact_bytes
        self.snapshots_written = 0
        self.replayed = 0
        self._snapshot_bytes = 0
        self.appended = 0  # records appended since recover()
        self.durable = 0   # of which durable (fsync'd, or covered by a snapshot)
        self.syncs = 0     # fsyncs of the log
        self.sync_seconds = Latencies()  # each fsync of the log
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)    # appended (the sync thread waits on it)
        self._synced = threading.Condition(self._lock)  # made durable (settle waits on it)
        self._io = threading.Lock()  # the log's file: its fsync vs a compaction replacing it
        self._waiting: list[tuple[int, asyncio.Future]] = []
        self._error: DpexError | None = None
        self._closing = False
        self._syncer: threading.Thread | None = None
        self.failing = False   # the last write failed (a full disk): an outage until one succeeds
        self.write_errors = 0  # writes that failed
        self.on_failing: Callable[[bool], None] = lambda failing: None  # told when an outage starts and ends

    def recover(self) -> DispatcherState:
        """The state the work dir holds; appends go on after it."""
        snap = read_snapshot(self.work_dir)
        if snap is not None:
            state, self.generation = snapshot.restore(snap), snap.generation
            self._snapshot_bytes = snap.ByteSize()
        else:
            state, self.generation = DispatcherState(), 0
        for entry in os.listdir(self.work_dir):  # other generations: a compaction cut short
            m = _LOG.match(entry)
            if (m and int(m.group(1) or 0) != self.generation) or entry == SNAPSHOT + ".tmp":
                os.unlink(os.path.join(self.work_dir, entry))
        self.journal = Journal(self.work_dir, log_name(self.generation))
        for update in self.journal.replay():
            state.apply(update)
            self.replayed += 1
        self._syncer = threading.Thread(target=self._sync_loop, name="dpex-journal-sync", daemon=True)
        self._syncer.start()
        return state

    @property
    def path(self) -> str:
        return self.journal.path

    @property
    def size(self) -> tuple[int, int]:
        """(the log's bytes, the snapshot's bytes): what the work dir holds of the state."""
        return self.journal.size, self._snapshot_bytes

    def refuse(self, error: OSError, what: str) -> NoReturn:
        """A write of the work dir's (``what``: its journal, its plan files) failed
        (a full disk): an outage until the journal is written again, refused as
        DpexConnectionError (UNAVAILABLE, which clients retry), nothing changed."""
        self.write_errors += 1
        if not self.failing:
            self.failing = True
            log.error("cannot write %s in %s (%s): changes are refused as an outage "
                      "(UNAVAILABLE; trainers and workers retry) until it can; free space on its disk",
                      what, self.work_dir, error.strerror or error)
            self.on_failing(True)
        raise DpexConnectionError(f"the dispatcher cannot write {what} ({error.strerror or error}); "
                                  "nothing was changed: retry once its disk has room") from None

    def append(self, update: jpb.Update) -> int:
        """Writes ``update`` (the caller applies it next); its position, durable
        once :meth:`settle` returns for it. A write that fails (a full disk)
        is an outage: DpexConnectionError (UNAVAILABLE, which clients retry),
        the update not written nor to be applied, until a write succeeds."""
        try:
            self.journal.append(update)
        except OSError as e:
            self.refuse(e, "its journal")
        if self.failing:
            self.failing = False
            log.warning("the journal in %s is written again: the outage is over", self.work_dir)
            self.on_failing(False)
        with self._cond:
            self.appended += 1
            self._cond.notify()
            return self.appended

    def settle(self, position: int) -> None:
        """Blocks until the updates up to ``position`` are durable."""
        with self._lock:
            while self.durable < position and self._error is None:
                self._synced.wait()
            if self.durable < position:
                raise self._error  # type: ignore[misc]

    async def settled(self, position: int) -> None:
        """:meth:`settle` for a coroutine: waits without holding a thread."""
        with self._lock:
            if self.durable >= position:
                return
            if self._error is not None:
                raise self._error
            future = asyncio.get_running_loop().create_future()
            self._waiting.append((position, future))
        await future

    def _sync_loop(self) -> None:
        while True:
            with self._cond:
                while self.durable >= self.appended and not self._closing:
                    self._cond.wait()
                if self.durable >= self.appended:
                    return
                target = self.appended
            try:
                with self._io:
                    started = time.perf_counter()
                    self.journal.sync()
                    self.sync_seconds.observe(time.perf_counter() - started)
            except OSError as e:  # the disk failed: no answer may claim durability from here on
                error = DpexError(f"the dispatcher cannot make its journal in {self.work_dir} durable "
                                  f"({e}); every call fails until it is restarted (it then recovers "
                                  "what is on disk)")
                log.critical("%s", error)
                self._durable(self.durable, error)
                return
            self.syncs += 1
            self._durable(target)

    def _durable(self, position: int, error: DpexError | None = None) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}  # the futures to resolve
        with self._lock:
            self.durable = max(self.durable, position)
            self._error = self._error or error
            waiting, self._waiting = self._waiting, []
            for p, future in waiting:
                if p <= self.durable or self._error is not None:
                    by_loop.setdefault(future.get_loop(), []).append(future)
                else:
                    self._waiting.append((p, future))
            self._synced.notify_all()
        for loop, futures in by_loop.items():  # one wake-up of each loop for the group
            try:
                loop.call_soon_threadsafe(_resolve, futures, self._error)
            except RuntimeError:  # its loop is closed: nobody waits any more
                pass

    def due(self, plan_ended: bool = False) -> bool:
        """Whether to compact now: the log is past ``compact_bytes`` and twice the
        snapshot, or an epoch plan just ended and the log is past half the
        snapshot (between epochs, what an epoch wrote goes: the disk holds the
        live state and at most half of it again)."""
        size, snap = self.journal.size, self._snapshot_bytes
        return self.compact_bytes > 0 and (size > max(self.compact_bytes, 2 * snap)
                                           or (plan_ended and size > max(snap // 2, _MIN_LOG)))

    def compact(self, state: DispatcherState) -> None:
        """Snapshot of ``state`` (everything appended so far applied), then a
        new log; where the snapshot cannot be written (a full disk), the log
        goes on as it is and a later compaction tries again."""
        snap = snapshot.take(state)
        snap.generation = self.generation + 1
        body = snap.SerializeToString()
        tmp = os.path.join(self.work_dir, SNAPSHOT + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            _unlink_quietly(tmp)
            log.warning("could not compact the journal in %s (%s); the log goes on", self.work_dir, e.strerror or e)
            return
        os.replace(tmp, os.path.join(self.work_dir, SNAPSHOT))
        try:
            self._start_generation(snap.generation, len(body))
        except OSError as e:  # the snapshot holds everything, the old log is no longer read: stop here
            error = DpexError(f"the dispatcher cannot start a new journal in {self.work_dir} ({e}); every call "
                              "fails until it is restarted (it then recovers from its snapshot)")
            log.critical("%s", error)
            self._durable(self.durable, error)
            raise error from None

    def _start_generation(self, generation: int, snapshot_bytes: int) -> None:
        fsync_dir(self.work_dir)
        with self._io:
            old, self.generation = self.journal, generation
            self.journal = Journal(self.work_dir, log_name(self.generation))
            old.close()
        os.unlink(old.path)
        self._snapshot_bytes = snapshot_bytes
        self.snapshots_written += 1
        self._durable(self.appended)  # the snapshot holds all of it

    def close(self) -> None:
        """Makes what was appended durable, then closes the log."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._syncer is not None and self._syncer is not threading.current_thread():
            self._syncer.join()
        self.journal.close()


def _resolve(futures: list[asyncio.Future], error: DpexError | None) -> None:
    for future in futures:
        if not future.done():  # (a call cancelled meanwhile)
            future.set_exception(error) if error is not None else future.set_result(None)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
