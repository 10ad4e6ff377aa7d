"""The suite's own servers leave nothing running after their block."""
import contextlib
import socket
import threading

from dpex.testing.servers import slow_link


def test_a_slow_link_ends_its_threads_with_its_block():
    """Its threads are blocked in accept() and, with a connection still open, in recv(): they end with it."""
    links = lambda: [t for t in threading.enumerate() if t.name == "dpex-test-slow-link"]  # noqa: E731
    with contextlib.ExitStack() as open_until_after:
        upstream = open_until_after.enter_context(socket.create_server(("127.0.0.1", 0)))
        with slow_link(f"127.0.0.1:{upstream.getsockname()[1]}", 0.2) as far:
            host, port = far.rsplit(":", 1)
            client = open_until_after.enter_context(socket.create_connection((host, int(port))))
            peer = open_until_after.enter_context(upstream.accept()[0])
            peer.sendall(b"late")
            assert client.recv(4) == b"late"  # its answer, 0.2 s late
            assert len(links()) == 3  # accept() and a pump each way
        assert not links()
