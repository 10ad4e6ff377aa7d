"""Shared-token authentication for every RPC between trainers, the
dispatcher and workers: ``authorization: Bearer <token>`` metadata, checked
in constant time by one server interceptor.

Shipped code (pickled datasets, callables) runs on workers, so without a
token a dispatcher accepts jobs only from loopback peers and a worker runs
jobs only from a loopback dispatcher, unless ``allow_unauthenticated``.
"""
from __future__ import annotations

import hmac
import logging
import os
from typing import Any, Callable

import grpc

from dpex.errors import DpexConfigError
from dpex.keys import Refusals

TOKEN_ENV = "DPEX_AUTH_TOKEN"
_KEY = "authorization"


def load_token(token_file: str | None = None, token: str | None = None) -> str | None:
    """The token from ``token``, else ``token_file``, else $DPEX_AUTH_TOKEN; None: no auth."""
    if token is None and token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise DpexConfigError(f"cannot read the auth token file {token_file}: {e}") from None
        if not token:
            raise DpexConfigError(f"the auth token file {token_file} is empty")
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return token


TLS_CA_ENV = "DPEX_TLS_CA"


def read_pem(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise DpexConfigError(f"cannot read the TLS {what} {path}: {e}") from None


def load_ca(path: str | None = None) -> bytes | None:
    """The CA certificates (PEM) to verify daemons with: ``path`` or $DPEX_TLS_CA; None: no TLS."""
    return read_pem(path or os.environ.get(TLS_CA_ENV), "CA file")


def server_credentials(cert_file: str | None, key_file: str | None) -> grpc.ServerCredentials | None:
    """TLS for a daemon's port from a certificate chain and key (PEM); None: plaintext."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise DpexConfigError("TLS needs both --tls-cert and --tls-key")
    return grpc.ssl_server_credentials([(read_pem(key_file, "key"), read_pem(cert_file, "certificate"))])


def is_loopback_host(host: str) -> bool:
    """Whether a daemon bound to ``host`` listens on loopback only (not 0.0.0.0, ::, or a host's address)."""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: whatever it resolves to may be reachable
        return False


def answers(peer: str, token: str | None, allow_unauthenticated: bool) -> bool:
    """Whether a daemon answers ``peer`` at all: with a token (checked by
    :class:`TokenCheck`) or ``allow_unauthenticated``, anyone; else loopback peers only."""
    return bool(token or allow_unauthenticated) or is_loopback_peer(peer)


def is_loopback_peer(peer: str) -> bool:
    """``context.peer()`` of a loopback client: ipv4:127.x, ipv6:[::1] or a unix socket."""
    return peer.startswith(("ipv4:127.", "ipv6:[::1]", "unix:"))


_REFUSED = "missing or wrong auth token: set DPEX_AUTH_TOKEN, --auth-token-file or auth_token="
_HANDLERS = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}


# Calls refused for their token, counted by reason and logged with the peer (the daemons' metrics).
refusals = Refusals(logging.getLogger("dpex.auth"))


def _refuse(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
    refusals.refuse("token", context.peer(), _REFUSED)
    context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)


async def _refuse_async(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
    refusals.refuse("token", context.peer(), _REFUSED)
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _REFUSED)  # a stream's too (a sync one would hang)


class TokenCheck(grpc.ServerInterceptor):
    """Rejects every call that does not carry the token (health checks excepted)."""

    _refusal: Callable = staticmethod(_refuse)

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        return self._check(details, continuation(details))

    def _check(self, details: grpc.HandlerCallDetails, handler: Any) -> Any:
        if details.method.startswith("/grpc.health."):
            return handler
        given = dict(details.invocation_metadata or ()).get(_KEY, "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        # Refuse in the method's own shape (a streaming method needs a streaming handler).
        shape = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
        return _HANDLERS[shape](self._refusal)


class AsyncTokenCheck(grpc.aio.ServerInterceptor, TokenCheck):
    """:class:`TokenCheck` for a ``grpc.aio`` server (the refusal a coroutine)."""

    _refusal = staticmethod(_refuse_async)

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        return self._check(details, await continuation(details))


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self._pair = (_KEY, f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or []) + [self._pair]
        return details._replace(metadata=metadata) if hasattr(details, "_replace") else _Details(
            details.method, details.timeout, metadata, details.credentials,
            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """The channel, sending the token with every call (unchanged when None)."""
    return grpc.intercept_channel(channel, _AddToken(token)) if token else channel
