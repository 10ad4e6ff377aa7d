"""Pinning as torch's DataLoader does it: in a thread of its own, ahead of
the consumer, with one intra-op thread.

Copying a batch into page-locked memory on the training thread, with torch's
whole intra-op pool, cost the trainer seconds of CPU per GB and stalled the
step that called ``next()``. Here a thread drives the epoch's fetcher, pins
each batch and queues at most ``depth`` pinned batches; ``next()`` only takes
the next one. The thread stops when the epoch ends, when the iterator is
closed or dropped (the epoch is then left), or on the first error, which
``next()`` raises.

Frames from a worker on another host come on its data socket; with pinning
they are read straight into page-locked memory (:class:`PinnedFrames`), so
their tensors arrive pinned and the thread above has nothing to copy: the
kernel's copy is the only one, as for a batch from a same-host worker.
"""
from __future__ import annotations

import queue
import socket
import threading
import time
from typing import Any, NamedTuple

from dpex import finalizers
from dpex.client.stats import StatsMeter
from dpex.client.buffers import read_exactly
from dpex.client.fetcher import BatchFailed
from dpex.errors import DpexCancelledError, warn
from dpex.wire.codec import ALIGN
from dpex.wire.frame import payload_offset


class PinTarget(NamedTuple):
    device_type: str   # the accelerator's type, e.g. "cuda"
    device_index: int  # the device whose context pins


def pin_target(pin_memory_device: str = "") -> PinTarget | None:
    """Where to pin: ``pin_memory_device`` ("cuda:1"), else the current
    accelerator; like torch, a warning and None without an accelerator."""
    import torch
    if not torch.accelerator.is_available():
        warn("'pin_memory' argument is set as true but no accelerator is found, "
             "then device pinned memory won't be used.")
        return None
    current = torch.accelerator.current_accelerator()
    if not pin_memory_device:
        return PinTarget(current.type, torch.accelerator.current_device_index())
    device = torch.device(pin_memory_device)
    if device.type != current.type:
        raise ValueError(f"pin_memory_device={pin_memory_device!r} is not this machine's accelerator "
                         f"({current.type})")
    return PinTarget(device.type, device.index if device.index is not None
                     else torch.accelerator.current_device_index())


class PinnedFrames:
    """Reads a data socket's frames into 1-D uint8 tensors from torch's
    caching host allocator (page-locked where ``target`` is given), with the
    payload 64-byte aligned so that every decoded tensor is a view of the
    frame's tensor: pinned without a copy, and a ``non_blocking`` copy from
    it keeps the block from reuse until the copy is done (torch records the
    copy on the block of a tensor's own storage)."""

    _HEAD = 1024  # bytes looked at for where the payload starts

    def __init__(self, target: PinTarget | None) -> None:
        self._target = target

    def __call__(self, sock: socket.socket, nbytes: int) -> Any:
        import torch
        head = sock.recv(min(nbytes, self._HEAD), socket.MSG_PEEK | socket.MSG_WAITALL)
        start = payload_offset(head)
        pad = -start % ALIGN if start is not None else 0  # else tensors needing alignment are copied
        buf = None
        if self._target is not None:
            torch.accelerator.set_device_index(self._target.device_index)  # this thread's device
            try:
                buf = torch.empty(pad + nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError:  # no page-locked memory left: the pinning thread tries, and says why
                pass
        if buf is None:
            buf = torch.empty(pad + nbytes, dtype=torch.uint8)
        read_exactly(sock, memoryview(buf.numpy())[pad:])
        return buf[pad:]


class _End(NamedTuple):
    error: BaseException | None


class _Pinner:
    """The thread's side; holds the fetcher, never the iterator that the
    trainer holds (so dropping that iterator stops this)."""

    def __init__(self, epoch: Any, target: PinTarget, depth: int, meter: StatsMeter) -> None:
        self.epoch = epoch
        self._meter = meter
        self.out: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._target = target
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dpex-pin-memory", daemon=True)

    def _run(self) -> None:
        import torch
        from dpex.torch_private import pin_memory
        torch.set_num_threads(1)  # thread-local: the copy must not take every core
        torch.accelerator.set_device_index(self._target.device_index)
        end = _End(None)
        try:
            while not self._stop.is_set():
                try:
                    batch, nbytes, seq = self.epoch.next_batch()
                except StopIteration:
                    break
                except BatchFailed as failed:  # the loop's to raise, in its turn
                    self._put(failed)
                    continue
                begun = time.perf_counter()
                batch = pin_memory(batch, self._target.device_type)
                self._meter.pinned(time.perf_counter() - begun)
                self._put((batch, nbytes, seq))
        except BaseException as e:  # noqa: B036 - handed to the consumer, raised there
            end = _End(e)
        finally:
            self.epoch.close()  # before its end: the epoch is left
        self._put(end)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self.out.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def stop(self) -> None:
        """Makes the thread end (leaving the epoch if unfinished); does not wait."""
        self._stop.set()
        self.epoch.interrupt()
        while True:  # a put blocked on a full queue returns, then sees the stop
            try:
                self.out.get_nowait()
            except queue.Empty:
                break
        try:  # a consumer blocked in next() on another thread ends too
            self.out.put_nowait(_End(None))
        except queue.Full:
            pass


class PinnedEpoch:
    """An epoch's iterator whose batches arrive pinned (see module doc)."""

    def __init__(self, epoch: Any, target: PinTarget, depth: int, meter: StatsMeter) -> None:
        self._pinner = _Pinner(epoch, target, depth, meter)
        self._key = epoch.key
        self._meter = meter
        self._done = False
        self._left_why: str | None = None
        self._finalizer = finalizers.finalize(self, self._pinner.stop)
        self._pinner.thread.start()

    def __iter__(self) -> "PinnedEpoch":
        return self

    def __len__(self) -> int:
        return len(self._pinner.epoch)

    @property
    def finished(self) -> bool:
        """Every batch of the epoch was yielded (pinned ones too)."""
        return self._done and self._pinner.epoch.finished

    @property
    def closed(self) -> bool:
        """Ended: finished, left, or failed."""
        return self._done

    def __next__(self) -> Any:
        if self._done:
            if self._left_why is not None:
                raise DpexCancelledError(self._left_why)
            raise StopIteration
        asked_at = time.monotonic()
        item = self._pinner.out.get()
        if isinstance(item, _End):
            self._done = True
            self._pinner.thread.join()
            if item.error is not None:
                raise item.error
            self._pinner.epoch.progress.ended = self._pinner.epoch.finished
            raise StopIteration
        if isinstance(item, BatchFailed):
            self._pinner.epoch.progress.add(item.seq)
            raise item.error from None
        batch, nbytes, seq = item
        self._pinner.epoch.progress.add(seq)  # given to the loop now, not when pinned
        self._meter.record(self._key, asked_at, nbytes)
        return batch

    def close(self, why: str | None = None) -> None:
        """Stops pinning; before the epoch's end, that is leaving it (``why``:
        another epoch took its place, which its next batch raises)."""
        if why is not None and not self._done:
            self._left_why = why
            self._pinner.epoch.close(why)  # from here: it is left before this returns
        self._done = True
        self._finalizer()
        if self._pinner.thread is not threading.current_thread():
            self._pinner.thread.join()
