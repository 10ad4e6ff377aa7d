"""The dispatcher's journal: an append-only file of Update records (the log
that follows a snapshot, dpex.dispatcher.store).

Each record is ``u32 length | u32 crc32 | serialized dpex.v1.Update``,
written (to the OS: a killed process loses none) before the update takes
effect; :meth:`Journal.sync` makes what was written durable (the store
fsyncs in groups, dpex.dispatcher.store). On start the records are
replayed in order; a torn or corrupt tail (a crash during a write) ends the
replay and is cut off, so that new records follow the last good one.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from typing import Iterator

from dpex.proto import journal_pb2 as jpb

log = logging.getLogger("dpex.dispatcher")

_HEADER = struct.Struct("<II")
FILE_NAME = "journal.log"


def read_records(path: str) -> tuple[list[jpb.Update], int]:
    """The good records of a journal, and the offset where they end."""
    updates: list[jpb.Update] = []
    good = 0
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return updates, 0
    while good + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, good)
        start, end = good + _HEADER.size, good + _HEADER.size + length
        if end > len(data) or zlib.crc32(data[start:end]) != crc:
            break
        try:
            updates.append(jpb.Update.FromString(data[start:end]))
        except Exception:  # a CRC match on garbage is unlikely; treat it as torn all the same
            break
        good = end
    if good < len(data):
        log.warning("journal %s: ignoring a torn or corrupt tail of %d bytes at offset %d",
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
        self._file = open(self.path, "ab")
        if self._file.tell() != good:  # drop the torn tail before appending
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
        """Writes ``update`` to the OS; durable once :meth:`sync` returns after it."""
        payload = update.SerializeToString()
        self._file.write(_HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
        self.size += _HEADER.size + len(payload)
        self._file.flush()

    def sync(self) -> None:
        """Makes every record appended so far durable (from any thread)."""
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
