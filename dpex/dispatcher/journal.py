"""The dispatcher's journal: an append-only file of Update records (the log
that follows a snapshot, dpex.dispatcher.store).

Each record is ``u32 length | u32 crc32 | serialized dpex.v1.Update``,
written (to the OS: a killed process loses none) before the update takes
effect; :meth:`Journal.sync` makes what was written durable (the store
fsyncs in groups, dpex.dispatcher.store). On start the records are
replayed in order. A torn tail (a crash during a write: a bad record with
no good one after it) ends the replay and is cut off, so that new records
follow the last good one; the bytes cut are kept beside it
(``journal.log.torn-OFFSET``). A bad record followed by good ones is
corruption, not a crash: the dispatcher refuses to start and the file is
left as it is (as a corrupt snapshot is refused, dpex.dispatcher.store).
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Iterator

from dpex.errors import DpexConfigError
from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")

_HEADER = struct.Struct("<II")
FILE_NAME = "journal.log"


def _record_at(data: bytes, at: int) -> tuple[jpb.Update, int] | None:
    """The record at offset ``at`` and where it ends, if a whole good one
    starts there (an Update is never empty: zeros, as a crash may leave, are no record)."""
    if at + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, at)
    start, end = at + _HEADER.size, at + _HEADER.size + length
    if not length or end > len(data) or zlib.crc32(data[start:end]) != crc:
        return None
    try:
        return jpb.Update.FromString(data[start:end]), end
    except Exception:  # a CRC match on garbage is unlikely; no record all the same
        return None


def read_records(path: str) -> tuple[list[jpb.Update], int]:
    """The good records of a journal, and the offset where they end (a torn
    tail follows). Raises DpexConfigError if a good record follows a bad one."""
    updates: list[jpb.Update] = []
    good = 0
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return updates, 0
    while (record := _record_at(data, good)) is not None:
        updates.append(record[0])
        good = record[1]
    if good < len(data):
        later = next((at for at in range(good + 1, len(data) - _HEADER.size) if _record_at(data, at)), None)
        if later is not None:
            raise DpexConfigError(
                f"the journal {path} is corrupt: the record at offset {good} is bad and good records follow it "
                f"(from offset {later}; a crash only tears the last one). Refusing to start; the file is kept as "
                f"it is. Restore the work dir from a backup, or move it aside to start with no state")
        log.warning("journal %s: ignoring a torn tail of %d bytes at offset %d (a write cut short)",
                    path, len(data) - good, good)
    return updates, good


def fsync_dir(path: str) -> None:
    """Makes a directory's entries (a file created or renamed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Journal:
    """Appends updates durably; ``replay()`` yields what an earlier run wrote."""

    def __init__(self, work_dir: str, name: str = FILE_NAME) -> None:
        os.makedirs(work_dir, exist_ok=True)
        self.path = os.path.join(work_dir, name)
        existed = os.path.exists(self.path)
        self._updates, good = read_records(self.path)
        self._file = open(self.path, "ab", buffering=0)  # unbuffered: a failed write leaves nothing to write later
        if self._file.tell() != good:  # drop the torn tail before appending, a copy of it kept
            with open(self.path, "rb") as f:
                f.seek(good)
                torn = f.read()
            with open(f"{self.path}.torn-{good}", "wb") as f:
                f.write(torn)
            self._file.truncate(good)
            self._file.seek(good)
            os.fsync(self._file.fileno())
        if not existed:
            fsync_dir(work_dir)
        self.size = good

    def replay(self) -> Iterator[jpb.Update]:
        updates, self._updates = self._updates, []
        yield from updates

    def append(self, update: jpb.Update) -> None:
        """Writes ``update`` to the OS; durable once :meth:`sync` returns after it.
        A write that fails (a full disk) raises OSError and leaves the file as
        it was: the part written is cut off, and nothing stays buffered to be
        written later (the update does not take effect, so it must not be in
        the journal either)."""
        payload = update.SerializeToString()
        record = memoryview(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        try:
            while record:
                record = record[self._file.write(record):]
        except OSError:
            self._file.truncate(self.size)
            raise
        self.size += _HEADER.size + len(payload)

    def sync(self) -> None:
        """Makes every record appended so far durable (from any thread)."""
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
