"""Receive buffers for frames from a data socket, reused once the batch they
hold is gone.

A fresh buffer of tens of MB is a fresh mapping (over glibc's mmap
threshold): the kernel faults in and zeroes every page of it, which cost the
trainer more CPU than the read itself (float32 batches of 37 MB: 0.52 s/GB
against 0.17 for 9 MB ones). Here a frame is read into a numpy array over an
anonymous mapping; when nothing refers to that array any more (every tensor
decoded from it dropped), the mapping goes back to the pool, already faulted
in, for the next frame of its size class.
"""
from __future__ import annotations

import mmap
import socket
import threading

import numpy as np

from dpex import finalizers

_PAGE = mmap.PAGESIZE


def read_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket (the kernel's copy only)."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise OSError("the worker closed the data socket")
        got += n


def size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to a page, then to 1/8 of its power of two:
    frames of one job's batches, a few bytes apart, share a class."""
    n = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    step = max(_PAGE, 1 << max(0, n.bit_length() - 4))
    return -(-n // step) * step


class FramePool:
    """Reads a frame into a pooled buffer (see module doc). At most
    ``keep_bytes`` of free buffers are kept; batches a trainer holds on to
    simply take new ones."""

    def __init__(self, keep_bytes: int = 512 << 20) -> None:
        self._keep = keep_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._free_bytes = 0
        self._lock = threading.RLock()  # a collection inside the lock may give a buffer back

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    def __call__(self, sock: socket.socket, nbytes: int) -> np.ndarray:
        frame = self.take(nbytes)
        read_exactly(sock, memoryview(frame))
        return frame

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes``, back in the pool when it is collected."""
        cls = size_class(nbytes)
        with self._lock:
            spare = self._free.get(cls)
            mm = spare.pop() if spare else None
            if mm is not None:
                self._free_bytes -= cls
        if mm is None:  # private: a child forked meanwhile keeps its own copy of what it holds
            mm = mmap.mmap(-1, cls, flags=mmap.MAP_PRIVATE)
        frame = np.frombuffer(mm, dtype=np.uint8, count=nbytes)
        finalizers.finalize(frame, self._give_back, cls, mm, at_exit=False)  # nothing to give back at exit
        return frame

    def _give_back(self, cls: int, mm: mmap.mmap) -> None:
        with self._lock:
            if self._free_bytes + cls <= self._keep:
                self._free.setdefault(cls, []).append(mm)
                self._free_bytes += cls
