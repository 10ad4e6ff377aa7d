"""The data socket beside a gRPC Fetch stream (a trainer on another host,
plain TCP): frames arrive on it, a broken socket is a broken stream (asked
again, nothing lost or doubled), garbage on the port harms no one, and
``--data-port -1`` keeps every batch in gRPC messages."""
import logging
import os
import select
import socket
import time

import dpex
from dpex.testing import test_cluster

SPEC = dpex.DatasetSpec("dpex.testing.datasets:Sized", 24, (1, 3))
SIZES = (1, 3)


def sockets(loader) -> list:
    return [s._sock for s in loader._session.streams._streams.values()]


def epoch(loader, cut_at=None) -> list[int]:
    got = []
    for i, batch in enumerate(loader):
        assert batch.shape == (1, SIZES[i % 2] << 20)
        got.append(int(batch[0, -1]))
        if i == cut_at:  # the network drops the socket mid-epoch
            sockets(loader)[0].shutdown(socket.SHUT_RDWR)
    return got


def test_frames_come_on_the_data_socket_and_a_broken_one_loses_nothing(cluster, caplog):
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
        assert epoch(dl) == list(range(24))
        assert all(s is not None for s in sockets(dl))
        with caplog.at_level(logging.WARNING, logger="dpex.client"):
            assert epoch(dl, cut_at=5) == list(range(24))  # exactly once, in order
        assert "data socket" in caplog.text  # the failure was seen, and recovered from
        assert epoch(dl) == list(range(24))


def test_garbage_and_silence_on_the_data_port_harm_no_one():
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
            assert epoch(dl) == list(range(24))
            port = sockets(dl)[0].getpeername()[1]
            silent = socket.create_connection(("127.0.0.1", port))
            for payload in (os.urandom(16), os.urandom(3), b"GET / HTTP/1.1\r\n\r\n" * 100):
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(payload)
            assert epoch(dl) == list(range(24))
            dl._session.streams.close()  # a new stream, a new socket, with the strangers still there
            assert epoch(dl) == list(range(24))
            silent.close()


def test_without_a_data_port_batches_stay_in_grpc_messages():
    with test_cluster(num_workers=1, worker_flags=("--data-port", "-1")) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
            assert epoch(dl) == list(range(24))
            assert sockets(dl) == [None]


def test_an_unreachable_data_port_falls_back_to_grpc_messages(cluster, monkeypatch, caplog):
    from dpex.client import streams

    def firewalled(address, port, key):
        raise ConnectionRefusedError(111, "Connection refused")
    monkeypatch.setattr(streams, "_connect", firewalled)
    with caplog.at_level(logging.WARNING, logger="dpex.client"), \
            dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
        assert epoch(dl) == list(range(24))
        assert all(s is None for s in sockets(dl))
    assert "receiving batches in gRPC messages instead" in caplog.text


def test_frames_read_into_tensors_arrive_as_views_of_them_and_a_broken_socket_loses_nothing(cluster):
    """What pin_memory does on this path (dpex.client.pinning.PinnedFrames; here
    without an accelerator, so not page-locked): each frame is read into one
    tensor, the payload aligned, and a batch's tensors are views of it."""
    from torch.utils.data import DataLoader

    from dpex.client.pinning import PinnedFrames
    from dpex.testing.datasets import Squares
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=64, dim=4096)  # frames of 128 KB: on the socket
    theirs = list(DataLoader(Squares(64, 4096), batch_size=8))
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=8, shared_memory=False, timeout=60) as dl:
        dl._session.streams.read_frame = PinnedFrames(None)
        for cut in (None, 2):
            ours = []
            for i, batch in enumerate(dl):
                ours.append(batch)
                if i == cut:
                    sockets(dl)[0].shutdown(socket.SHUT_RDWR)
            assert [b["y"].tolist() for b in ours] == [b["y"].tolist() for b in theirs]  # exactly once, in order
            assert all(a["x"].equal(b["x"]) for a, b in zip(ours, theirs))
            for b in ours:  # one storage per batch: the frame's, nothing copied out of it
                storage = b["x"].untyped_storage()
                assert storage.data_ptr() == b["y"].untyped_storage().data_ptr()
                assert storage.nbytes() > b["x"].nbytes + b["y"].nbytes
                assert b["x"].storage_offset() * 4 % 64 == 0 and b["y"].storage_offset() * 8 % 64 == 0
        assert all(s is not None for s in sockets(dl))


def test_a_frame_that_cannot_be_received_is_a_failed_stream_asked_again(cluster, caplog):
    """An error in the receiving thread (here: no memory for a frame) fails
    that stream and its batches are asked for again; it never stops the
    thread silently, leaving the epoch waiting for batches that never come."""
    with dpex.RemoteDataLoader(cluster.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
        pool, calls = dl._session.streams, []
        read = pool.read_frame

        def short_of_memory(sock, nbytes):
            calls.append(nbytes)
            if len(calls) == 3:
                raise MemoryError(f"cannot allocate {nbytes} bytes")
            return read(sock, nbytes)
        pool.read_frame = short_of_memory
        with caplog.at_level(logging.WARNING, logger="dpex.client"):
            assert epoch(dl) == list(range(24))  # exactly once, in order
    assert "MemoryError: cannot allocate" in caplog.text


def turned_away(s: socket.socket) -> bool:
    """The worker closed `s`: an end of stream, or a reset when it closed
    with bytes of ours still unread (which the kernel answers with RST)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_flood_of_strangers_is_turned_away_at_once_and_the_loader_goes_on():
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=1, shared_memory=False, timeout=60) as dl:
            assert epoch(dl) == list(range(24))
            port = sockets(dl)[0].getpeername()[1]
            for _ in range(10):  # 1,000 sockets that send a key the worker never handed out: closed at once
                strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
                for s in strangers:
                    s.sendall(os.urandom(16))
                for s in strangers:
                    s.settimeout(10)
                    assert turned_away(s)
                    s.close()
            # Sockets that say nothing: a few per source address wait for their key (5 s), the rest go at once.
            opened = time.monotonic()
            silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
            ended, waiting = [], {s.fileno(): s for s in silent}
            while waiting and time.monotonic() - opened < 30:
                for fd in select.select(list(waiting), [], [], 1.0)[0]:
                    assert waiting.pop(fd).recv(1) == b""  # closed by the worker
                    ended.append(time.monotonic() - opened)
            assert not waiting  # every one is closed in the end
            held = sum(t >= 4.0 for t in ended)  # closed only at the end of their 5 s to send a key
            assert 0 < held <= 16 and len(ended) - held >= 24
            assert epoch(dl) == list(range(24))  # the paired stream goes on, exactly once
            for s in silent:
                s.close()
            dl._session.streams.close()  # a new stream pairs a new socket
            assert epoch(dl) == list(range(24))
            assert all(s is not None for s in sockets(dl))
