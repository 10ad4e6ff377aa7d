"""Explicit plans (a sampler that is not torch's own) kept on disk, not in memory.

A plan arrives in chunks; each is appended to a file as it comes, so the
dispatcher never holds a whole plan. A file holds the batches back to back
(``u32 count | count x i64 | places``; the count's top bit is IndexBatch.whole, the next says that
IndexBatch.places follow as i64s, one per index or one for a whole element); a side file holds, per split, where its
batches start, so that one split is read with two small reads.
Files live in the work dir's ``plans/`` (or a temporary directory when the
dispatcher keeps no journal), are fsync'd before the plan is journaled, and
are deleted once no plan refers to them.
"""
from __future__ import annotations

import os
import struct
import sys
import threading
import time
from array import array
from dataclasses import dataclass, field

from dpex.dispatcher.journal import fsync_dir
from dpex.errors import DpexConfigError, DpexNotFoundError
from dpex.plan.spec import PlanHash
from dpex.proto import dispatcher_pb2 as dpb

_COUNT = struct.Struct("<I")
_WHOLE = 1 << 31  # in a record's count: the batch is an unbatched job's list element
_PLACES = 1 << 30  # in a record's count: its places follow its indices
_OFFSET = struct.Struct("<Q")
_MAX_UPLOADS = 1024  # unfinished uploads kept; the oldest is dropped (its trainer starts again)
_YOUNG_S = 60.0      # a file this new may belong to a plan about to be journaled: kept


@dataclass
class _Upload:
    name: str
    hash: PlanHash
    data: object
    index: object
    next_chunk: int = 0
    num_batches: int = 0
    offset: int = 0
    meta: tuple = field(default_factory=tuple)  # (job, consumer, epoch, base_seed) it was started for


class PlanFiles:
    def __init__(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        for entry in os.listdir(directory):  # uploads cut short by a crash
            if entry.endswith(".tmp"):
                os.unlink(os.path.join(directory, entry))
        self._uploads: dict[int, _Upload] = {}
        self._lock = threading.Lock()

    def add(self, upload_id: int, chunk: int, batches: list[dpb.IndexBatch], split_size: int,
            meta: tuple) -> _Upload:
        """Appends chunk ``chunk`` of an upload started for ``meta`` (job, consumer,
        epoch, base seed); a chunk sent again (a retry) is ignored."""
        with self._lock:
            upload = self._uploads.get(upload_id)
            if chunk == 0 and (upload is None or upload.next_chunk > 1 or upload.meta != meta):
                if upload is not None:
                    self._abandon(upload_id)
                name = f"plan-{upload_id:016x}-{meta[2]}"
                upload = _Upload(name, PlanHash(meta[3], 0),
                                 open(self._path(name + ".tmp"), "wb"), open(self._path(name + ".splits.tmp"), "wb"),
                                 meta=meta)
                self._uploads[upload_id] = upload
                while len(self._uploads) > _MAX_UPLOADS:
                    self._abandon(next(iter(self._uploads)))
            if upload is None or upload.meta != meta or chunk > upload.next_chunk:
                raise DpexNotFoundError(f"plan upload {upload_id:x} has no chunk {chunk - 1} here (the dispatcher "
                                        "restarted?); send the plan again from its first chunk")
            if chunk < upload.next_chunk:
                return upload  # a retry of a chunk whose answer was lost
            try:
                self._write(upload, batches, split_size)
            except OSError:  # a full disk: the upload is dropped, and sent again from its first chunk
                self._abandon(upload_id)
                raise
            upload.hash.update(batches)
            upload.next_chunk += 1
            return upload

    @staticmethod
    def _write(upload: _Upload, batches: list[dpb.IndexBatch], split_size: int) -> None:
        """Writes ``batches`` to the upload's files (buffered: a full disk may show at finish)."""
        for batch in batches:
            if upload.num_batches % split_size == 0:
                upload.index.write(_OFFSET.pack(upload.offset))
            indices = array("q", batch.indices)
            if len(indices) >= _PLACES:
                raise DpexConfigError(f"a planned batch of {len(indices)} indices is too large")
            places = array("q", batch.places)
            if places and len(places) != (1 if batch.whole else len(indices)):
                raise DpexConfigError(f"a planned batch has {len(places)} places for {len(indices)} indices")
            if sys.byteorder != "little":
                indices.byteswap()
                places.byteswap()
            flags = (_WHOLE if batch.whole else 0) | (_PLACES if places else 0)
            record = _COUNT.pack(len(indices) | flags) + indices.tobytes() + places.tobytes()
            upload.data.write(record)
            upload.offset += len(record)
            upload.num_batches += 1

    def finish(self, upload_id: int) -> tuple[str, int, bytes]:
        """Makes an upload's file durable: (file name, batches, plan hash)."""
        with self._lock:
            upload = self._uploads.pop(upload_id)
        try:
            upload.index.write(_OFFSET.pack(upload.offset))
            for f in (upload.data, upload.index):
                f.flush()
                os.fsync(f.fileno())
                f.close()
            os.replace(self._path(upload.name + ".tmp"), self._path(upload.name))
            os.replace(self._path(upload.name + ".splits.tmp"), self._path(upload.name + ".splits"))
            fsync_dir(self.directory)
        except OSError:  # a full disk: dropped, the plan sent again from its first chunk
            _discard(upload, self.directory)
            raise
        return upload.name, upload.num_batches, upload.hash.digest()

    def read(self, name: str, index: int, count: int) -> list[dpb.IndexBatch]:
        """The ``count`` batches of split ``index`` of a plan file."""
        try:
            with open(self._path(name + ".splits"), "rb") as f:
                start, end = struct.unpack("<2Q", os.pread(f.fileno(), 16, index * _OFFSET.size))
            with open(self._path(name), "rb") as f:
                data = os.pread(f.fileno(), end - start, start)
        except (OSError, struct.error) as e:
            raise DpexConfigError(f"plan file {name} is unreadable ({e}); the trainer must submit the plan again")
        out, at = [], 0
        for _ in range(count):
            (n,) = _COUNT.unpack_from(data, at)
            whole, placed, n = bool(n & _WHOLE), bool(n & _PLACES), n & ~(_WHOLE | _PLACES)
            m = (1 if whole else n) if placed else 0
            at += _COUNT.size
            out.append(dpb.IndexBatch(indices=struct.unpack_from(f"<{n}q", data, at), whole=whole,
                                      places=struct.unpack_from(f"<{m}q", data, at + 8 * n)))
            at += 8 * (n + m)
        return out

    def keep(self, names: set[str]) -> None:
        """Deletes finished files no plan refers to (but none just written)."""
        young = time.time() - _YOUNG_S
        for entry in os.listdir(self.directory):
            base = entry[:-len(".splits")] if entry.endswith(".splits") else entry
            if entry.endswith(".tmp") or base in names:
                continue
            try:
                if os.stat(self._path(entry)).st_mtime < young:
                    os.unlink(self._path(entry))
            except FileNotFoundError:
                pass

    def close(self) -> None:
        with self._lock:
            for upload_id in list(self._uploads):
                self._abandon(upload_id)

    def _abandon(self, upload_id: int) -> None:
        _discard(self._uploads.pop(upload_id), self.directory)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)


def _discard(upload: _Upload, directory: str) -> None:
    """Closes an upload's files and removes them (what a full disk left unwritten is dropped)."""
    for f, suffix in ((upload.data, ".tmp"), (upload.index, ".splits.tmp")):
        try:
            f.close()
        except OSError:  # its buffer could not be written (a full disk): dropped with the file
            pass
        try:
            os.unlink(os.path.join(directory, upload.name + suffix))
        except FileNotFoundError:
            pass
