"""A batch process's hand-off files, written in place and kept mapped.

A default_collate batch is stacked straight into its hand-off file
(dpex.shm), not into memory of the process's own and then copied into the
file: one batch-sized copy fewer. The file's data section starts at ``HEAD``
bytes, a page boundary; the frame's head (its Batch metadata and the
payload's msgpack header) is written just before it, so the frame starts at
an offset in the file (``shm.Handoff.offset``).

A file comes back to the worker as a spare once it was read (by the daemon)
or given back (by a same-host trainer). A process keeps its mappings of the
files it wrote and claims its own spares first: their pages are mapped
already, so a batch does not fault them in again (mapping a file afresh costs
as much as the copy it saves). Each mapped file is held open, so that its
inode number cannot name another file meanwhile; one that somebody removed
is let go at the next claim, or by a thread of its own within seconds (the
worker removes spares nobody took for a while: dpex.shm.sweep_spares). So a
process holds at most ``KEEP`` batches of file memory beyond the files that
exist, and an idle one none.
"""
from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import OrderedDict
from typing import NamedTuple

import torch

from dpex import shm

HEAD = 64 << 10  # room for the frame's head before the data section; a larger head takes the copy
TAIL = 64 << 10  # room after the stacked tensors for the batch's other buffers (its labels)
KEEP = 4         # mappings a process keeps: its files in flight and its spares (at most 4 batches' memory)


class Slab(NamedTuple):
    path: str
    fd: int
    mapped: mmap.mmap
    data: torch.Tensor  # uint8: the file's data section, mapped
    address: int        # of data[0]


class Slabs:
    """The hand-off files of one batch process (``directory``: its daemon's)."""

    def __init__(self, directory: str, keep_spares: int, watch_s: float = shm.SPARE_IDLE_S / 2) -> None:
        self._directory, self._keep_spares = directory, keep_spares
        self._mapped: OrderedDict[int, Slab] = OrderedDict()  # by inode
        self._lock = threading.Lock()  # the mappings, between the batch and the watcher
        threading.Thread(target=_watch, args=(weakref.ref(self), watch_s), name="dpex-slabs", daemon=True).start()

    def claim(self, name: str, nbytes: int) -> Slab | None:
        """A file named ``name`` with a data section of ``nbytes`` or more,
        mapped: a spare (this process's own first), else a new one; None if
        it cannot be had (the copy it is)."""
        path = os.path.join(self._directory, name)
        try:
            fd = shm.claim_spare(self._directory, path, self._keep_spares, prefer=f"{os.getpid()}-s",
                                 flags=os.O_RDWR)
            if fd is None:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            return self._mapping(path, fd, HEAD + nbytes + TAIL)
        except (OSError, ValueError) as e:  # e.g. ENOSPC: a container's small /dev/shm
            os.close(fd)
            shm.discard(shm.Handoff(path, 0))
            if isinstance(e, OSError):
                shm.too_small(self._directory, nbytes, e)
            return None

    def _mapping(self, path: str, fd: int, size: int) -> Slab:
        with self._lock:
            return self._mapped_now(path, fd, size)

    def _mapped_now(self, path: str, fd: int, size: int) -> Slab:
        self._let_go_of_removed()
        st = os.fstat(fd)
        held = self._mapped.pop(st.st_ino, None)
        if held is not None and len(held.mapped) == st.st_size >= size:
            os.close(fd)  # the one held open is the same file
            self._mapped[st.st_ino] = held._replace(path=path)
            return self._mapped[st.st_ino]
        if held is not None:
            os.close(held.fd)
        if st.st_size < size:  # its pages reserved now: a full /dev/shm is ENOSPC here, not SIGBUS at a write
            os.posix_fallocate(fd, 0, size)
        size = max(size, st.st_size)
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=HEAD, count=size - HEAD)
        self._mapped[st.st_ino] = Slab(path, fd, mapped, data, data.data_ptr())
        while len(self._mapped) > KEEP:
            os.close(self._mapped.popitem(last=False)[1].fd)
        return self._mapped[st.st_ino]

    def _let_go_of_removed(self) -> None:
        for ino, slab in list(self._mapped.items()):
            try:
                gone = os.fstat(slab.fd).st_nlink == 0
            except OSError:
                gone = True
            if gone:
                del self._mapped[ino]
                os.close(slab.fd)

    def finish(self, slab: Slab, head: bytes, copies: list, data_size: int, meta: bytes) -> shm.Handoff | None:
        """The frame: ``head`` written just before the data section, and the
        buffers that were not stacked there at their ``copies`` offsets; None
        if the head does not fit (the batch is copied; the caller releases the file)."""
        start = HEAD - len(head)
        if start < 0:
            return None
        slab.mapped[start:HEAD] = head
        for offset, buf in copies:
            end = HEAD + offset + buf.nbytes
            if end <= len(slab.mapped):
                slab.mapped[HEAD + offset:end] = buf
            else:
                os.pwrite(slab.fd, buf, HEAD + offset)  # the file grows: mapped again at its next claim
        return shm.Handoff(slab.path, HEAD + data_size - start, meta, start)

    def release(self, slab: Slab) -> None:
        """A file claimed but not sent: a spare again (still mapped here)."""
        directory, name = os.path.split(slab.path)
        try:
            os.rename(slab.path, os.path.join(directory, shm.SPARE + name))
        except OSError:
            pass

    def close(self) -> None:
        """Lets go of every mapping (their files stay)."""
        while self._mapped:
            os.close(self._mapped.popitem()[1].fd)

    def offset_of(self, slab: Slab, address: int, nbytes: int) -> int | None:
        """Where a buffer lies in the slab's data section, if it does."""
        offset = address - slab.address
        return offset if 0 <= offset and offset + nbytes <= slab.data.numel() else None


def _watch(slabs: "weakref.ref[Slabs]", every_s: float) -> None:
    """Lets go of removed files while no batch comes (the process is idle), until the Slabs go."""
    wake = threading.Event()
    while not wake.wait(every_s):
        held = slabs()
        if held is None:
            return
        with held._lock:
            held._let_go_of_removed()
        del held
