"""dpex.rpc.call against a real gRPC server on loopback: what a call does
when its own channel is closed under it."""
import asyncio
import logging
import threading

import grpc
import pytest

from dpex import rpc
from dpex.errors import DpexCancelledError
from dpex.testing.servers import serving


def test_a_call_whose_channel_is_closed_under_it_is_cancelled_quietly_not_an_outage(caplog):
    # Closing a loader closes its channel while its control thread polls: that read
    # "cannot reach dispatcher ... (Channel closed!); retrying for 60s" (the differential tester's long run).
    arrived, release = threading.Event(), threading.Event()

    async def slow(request, context):
        arrived.set()
        while not release.is_set():
            await asyncio.sleep(0.01)
        return b""

    handler = grpc.method_handlers_generic_handler(
        "test.Slow", {"Call": grpc.unary_unary_rpc_method_handler(slow)})
    with serving(handler) as address:
        channel = grpc.insecure_channel(address)
        method = channel.unary_unary("/test.Slow/Call")
        closer = threading.Thread(target=lambda: (arrived.wait(10), channel.close()))
        closer.start()
        try:
            with caplog.at_level(logging.WARNING, logger="dpex.rpc"), pytest.raises(DpexCancelledError):
                rpc.call(method, b"", target=f"dispatcher {address}", timeout_s=30, retry_for_s=60)
        finally:
            release.set()
            closer.join()
    assert not [r for r in caplog.records if "cannot reach" in r.getMessage()]
