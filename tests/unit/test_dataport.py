"""The worker's data port on a real loopback socket, without a worker:
a socket is handed to the stream that holds its key, once; strangers,
garbage and floods are turned away; a Sender writes frames in order."""
import socket

import pytest

from dpex.testing import wait_until
from dpex.worker import dataport
from dpex.wire.pairing import KEY_BYTES
from dpex.worker.dataport import DataPort, Sender


@pytest.fixture
def port():
    p = DataPort("127.0.0.1")
    yield p
    p.close()


def connect(port: DataPort, key: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port.port))
    if key:
        s.sendall(key)
    return s


def closed_by_peer(s: socket.socket) -> bool:
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_the_socket_that_sends_a_key_is_claimed_with_it_once(port):
    key = port.new_key()
    with connect(port, key) as trainer:
        conn = port.claim(key, timeout_s=10)
        assert conn is not None
        with conn:
            conn.sendall(b"frame")
            assert trainer.recv(5) == b"frame"
        assert port.claim(key, timeout_s=0.05) is None  # spent


def test_a_key_never_handed_out_or_spent_gets_the_socket_closed(port):
    with connect(port, b"x" * KEY_BYTES) as stranger:
        assert closed_by_peer(stranger)
    key = port.new_key()
    assert port.claim(key, timeout_s=0.05) is None  # nobody came: spent all the same
    with connect(port, key) as late:
        assert closed_by_peer(late)


def test_garbage_then_silence_closes_a_socket(port, monkeypatch):
    monkeypatch.setattr(dataport, "_HANDSHAKE_S", 0.2)
    with connect(port) as silent:
        silent.sendall(b"abc")  # a short key, then nothing
        assert closed_by_peer(silent)


def test_a_flood_from_one_host_is_turned_away_without_a_thread_each(port, monkeypatch):
    monkeypatch.setattr(dataport, "_MAX_HANDSHAKES_PER_HOST", 3)
    flood = [connect(port) for _ in range(3)]  # silent: each holds a handshake
    try:
        with connect(port) as one_more:
            assert closed_by_peer(one_more)
    finally:
        for s in flood:
            s.close()
    # Once the port has seen the flood's sockets close (each in its own
    # handshake's thread, which a loaded machine may run late), a trainer's
    # socket is taken again.
    wait_until(lambda: not port._handshakes, 10, "the flood's handshakes to end")
    key = port.new_key()
    with connect(port, key):
        assert port.claim(key, timeout_s=10) is not None


def test_a_sender_writes_frames_in_order_and_a_failure_stops_it_quietly():
    a, b = socket.socketpair()
    sender = Sender(a)
    frames = [bytes([i]) * (1000 * i + 1) for i in range(20)]
    for frame in frames:
        sender.send(frame)
    got = bytearray()
    b.settimeout(10)
    while len(got) < sum(map(len, frames)):
        got += b.recv(1 << 16)
    assert bytes(got) == b"".join(frames)
    b.close()  # the trainer went away
    for _ in range(50):
        sender.send(b"z" * (1 << 16))
    sender.close()
    assert isinstance(sender.failed, OSError)
