"""The dispatcher's durable state: a snapshot plus the log written after it.

``recover`` reads the snapshot (if any) and replays the log that follows it;
``append`` writes an update durably before it takes effect; once the log has
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
"""
from __future__ import annotations

import logging
import os
import re
import struct
import zlib

from dpex.dispatcher import snapshot
from dpex.dispatcher.journal import Journal, fsync_dir
from dpex.dispatcher.state import DispatcherState
from dpex.errors import DpexConfigError
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
        return state

    @property
    def path(self) -> str:
        return self.journal.path

    def append(self, update: jpb.Update) -> None:
        self.journal.append(update)

    def due(self, plan_ended: bool = False) -> bool:
        """Whether to compact now: the log is past ``compact_bytes`` and twice the
        snapshot, or an epoch plan just ended and the log is past half the
        snapshot (between epochs, what an epoch wrote goes: the disk holds the
        live state and at most half of it again)."""
        size, snap = self.journal.size, self._snapshot_bytes
        return self.compact_bytes > 0 and (size > max(self.compact_bytes, 2 * snap)
                                           or (plan_ended and size > max(snap // 2, _MIN_LOG)))

    def compact(self, state: DispatcherState) -> None:
        """Snapshot of ``state`` (everything appended so far applied), then a new log."""
        snap = snapshot.take(state)
        snap.generation = self.generation + 1
        body = snap.SerializeToString()
        tmp = os.path.join(self.work_dir, SNAPSHOT + ".tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(len(body), zlib.crc32(body)) + body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(self.work_dir, SNAPSHOT))
        fsync_dir(self.work_dir)
        old, self.generation = self.journal, snap.generation
        self.journal = Journal(self.work_dir, log_name(self.generation))
        old.close()
        os.unlink(old.path)
        self._snapshot_bytes = len(body)
        self.snapshots_written += 1

    def close(self) -> None:
        self.journal.close()
