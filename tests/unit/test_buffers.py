"""Receive buffers for data-socket frames: reused only once nothing refers
to the batch they hold, and never more than the pool may keep."""
import gc
import os
import socket
import threading

import torch

from dpex.client.buffers import FramePool, size_class
from dpex.wire import decode, encode


def _receive(read, payload: bytes):
    """The frame ``read`` (a FramePool, PinnedFrames) makes of ``payload`` sent on a socket."""
    a, b = socket.socketpair()
    with a, b:
        sender = threading.Thread(target=a.sendall, args=(payload,))
        sender.start()
        frame = read(b, len(payload))
        sender.join()
    return frame


def _address(frame) -> int:
    return frame.ctypes.data


def test_a_buffer_is_reused_only_after_every_tensor_decoded_from_it_is_gone():
    pool = FramePool()
    first = torch.arange(300_000, dtype=torch.float32)
    frame = _receive(pool, encode({"x": first}))
    batch = decode(memoryview(frame))
    where = _address(frame)
    del frame
    gc.collect()
    assert pool.free_bytes == 0  # the batch still holds it
    other = _receive(pool, encode({"x": torch.zeros(300_000)}))
    assert _address(other) != where and batch["x"].equal(first)  # a new buffer: the batch is intact
    del batch
    gc.collect()
    assert pool.free_bytes == size_class(len(memoryview(other)))
    again = _receive(pool, encode({"x": torch.ones(300_000)}))
    assert _address(again) == where and decode(memoryview(again))["x"].equal(torch.ones(300_000))
    assert pool.free_bytes == 0


def test_a_child_forked_while_a_batch_is_held_keeps_its_own_copy():
    pool = FramePool()
    frame = _receive(pool, encode({"x": torch.zeros(300_000)}))
    where, batch = _address(frame), decode(memoryview(frame))
    del frame
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: once the parent has reused the buffer, is its batch still zeros?
        os.close(w)
        os.read(r, 1)
        os._exit(0 if not batch["x"].numpy().any() else 1)
    os.close(r)
    del batch
    gc.collect()
    again = _receive(pool, encode({"x": torch.ones(300_000)}))
    assert _address(again) == where  # the same buffer, overwritten here
    os.write(w, b"x")
    os.close(w)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def test_the_pool_keeps_at_most_its_limit():
    pool = FramePool(keep_bytes=3 * size_class(1 << 20))
    frames = [pool.take(1 << 20) for _ in range(5)]
    del frames
    gc.collect()
    assert pool.free_bytes == 3 * size_class(1 << 20)


def test_size_classes_round_up_a_little():
    for n in (1, 4095, 4096, 9_633_000, 38_535_000, 1 << 30):
        c = size_class(n)
        assert n <= c <= max(4096, n * 1.13) and c % 4096 == 0
    assert size_class(38_535_000) == size_class(38_535_100)  # frames a few bytes apart share one


def test_pinned_frames_align_the_payload_and_fall_back_to_plain_memory(monkeypatch):
    from dpex.client.pinning import PinnedFrames, PinTarget
    from dpex.proto import worker_pb2 as wpb
    from dpex.wire import build_frame, parse_frame
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    real_empty, asked = torch.empty, []

    def no_pinned_memory_left(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(*args, **kwargs)
    monkeypatch.setattr(torch, "empty", no_pinned_memory_left)
    x = torch.arange(50_000, dtype=torch.float64)
    frame = _receive(PinnedFrames(PinTarget("cuda", 0)), build_frame(wpb.Batch(seq=5), encode({"x": x})))
    assert asked == [True, False]  # pinned first; plain memory, and the pinning thread will say why
    meta, payload = parse_frame(frame)
    got = decode(payload)["x"]
    assert meta.seq == 5 and got.equal(x)
    assert got.untyped_storage().data_ptr() == frame.untyped_storage().data_ptr()  # a view, no copy
    assert got.storage_offset() * 8 % 64 == 0  # the payload was placed 64-byte aligned

