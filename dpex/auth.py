"""Shared-token authentication for every RPC between trainers, the
dispatcher and workers: ``authorization: Bearer <token>`` metadata, checked
in constant time by one server interceptor.

A daemon's token file may hold several tokens, one per line: the first is
the one it sends, and each is accepted, so that a token is rotated without
downtime (the new beside the old, then the new first, then the new alone).
The file, and a daemon's TLS certificate and key, are read again when they
change, and at once on SIGHUP.

Shipped code (pickled datasets, callables) runs on workers, so without a
token a dispatcher accepts jobs only from loopback peers and a worker runs
jobs only from a loopback dispatcher, unless ``allow_unauthenticated``.
"""
from __future__ import annotations

import hmac
import logging
import os
import ssl
import tempfile
import threading
import time
from typing import Any, Callable

import grpc

from dpex.errors import DpexConfigError
from dpex.keys import Refusals

TOKEN_ENV = "DPEX_AUTH_TOKEN"
_KEY = "authorization"
_log = logging.getLogger("dpex.auth")


def read_tokens(token_file: str) -> list[str]:
    """The tokens in ``token_file``, one per line (the first is the one sent)."""
    try:
        with open(token_file) as f:
            tokens = [line.strip() for line in f if line.strip()]
    except OSError as e:
        raise DpexConfigError(f"cannot read the auth token file {token_file}: {e}") from None
    if not tokens:
        raise DpexConfigError(f"the auth token file {token_file} is empty")
    return tokens


def load_token(token_file: str | None = None, token: str | None = None) -> str | None:
    """The token from ``token``, else ``token_file`` (its first), else $DPEX_AUTH_TOKEN; None: no auth."""
    if token is None and token_file:
        token = read_tokens(token_file)[0]
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return token


def _stamp(*paths: str) -> tuple:
    """What tells that files changed (replaced, rewritten or resized); () if one cannot be looked at."""
    try:
        return tuple((st.st_ino, st.st_mtime_ns, st.st_size) for st in map(os.stat, paths))
    except OSError:
        return ()


class Tokens:
    """The tokens a daemon accepts and the one it sends: one fixed token, or a
    token file's lines, read again when the file changes (looked at no more
    than once a second, on a call) or when :meth:`reload` is called (SIGHUP).
    A file that cannot be read, or is empty, keeps the tokens it had, said in
    the log: a rotation half done must not shut the cluster out."""

    def __init__(self, token: str | None = None, token_file: str | None = None, check_every_s: float = 1.0) -> None:
        self._file, self._every = token_file, check_every_s
        self._tokens = read_tokens(token_file) if token_file else [token] if token else []
        self._expected = [f"Bearer {t}".encode() for t in self._tokens]
        self._seen = self._stamp()
        self._next_check = time.monotonic() + check_every_s
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._tokens)

    def _stamp(self) -> tuple:
        return _stamp(self._file) if self._file else ()

    def reload(self) -> bool:
        """Reads the file again (if any); whether the tokens changed."""
        if not self._file:
            return False
        with self._lock:
            self._seen = self._stamp()
            try:
                tokens = read_tokens(self._file)
            except DpexConfigError as e:
                _log.error("%s; the tokens read before stay", e)
                return False
            if tokens == self._tokens:
                return False
            self._tokens, self._expected = tokens, [f"Bearer {t}".encode() for t in tokens]
        _log.warning("auth tokens read again from %s: %d accepted", self._file, len(tokens))
        return True

    def _fresh(self) -> None:
        now = time.monotonic()
        if self._file and now >= self._next_check:
            self._next_check = now + self._every
            if self._stamp() != self._seen:
                self.reload()

    def current(self) -> str | None:
        """The token to send (the file's first)."""
        self._fresh()
        return self._tokens[0] if self._tokens else None

    def accepts(self, authorization: bytes) -> bool:
        """Whether an ``authorization`` header carries one of the tokens (each compared in constant time)."""
        self._fresh()
        return any([hmac.compare_digest(authorization, e) for e in self._expected])


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


class Certificate:
    """A daemon's certificate chain and key (PEM files), read again once they
    changed (a renewed certificate needs no restart): its gRPC port and its
    metrics endpoint each ask for the newest at a handshake."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self._lock = threading.Lock()
        self._seen = self._stamp()
        self.pem = (read_pem(key_file, "key"), read_pem(cert_file, "certificate"))
        self.version = 0  # counts the times the files were read again

    def _stamp(self) -> tuple:
        return _stamp(self.cert_file, self.key_file)

    def current(self) -> tuple[int, tuple[bytes, bytes]]:
        """(version, (key, chain)): the files read again if they changed and form a pair."""
        with self._lock:
            now = self._stamp()
            if now != self._seen:
                try:
                    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert_file, self.key_file)
                    self.pem = (read_pem(self.key_file, "key"), read_pem(self.cert_file, "certificate"))
                except (DpexConfigError, ssl.SSLError, OSError) as e:  # e.g. the key replaced, the chain not yet
                    _log.error("TLS certificate and key not read again (%s); those in use stay", e)
                else:
                    self.version += 1
                    _log.warning("TLS certificate and key read again from %s and %s", self.cert_file, self.key_file)
                self._seen = now
            return self.version, self.pem

    def ssl_context(self) -> ssl.SSLContext:
        """A server context from the newest pair (for an HTTPS endpoint)."""
        _, (key, chain) = self.current()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        with tempfile.TemporaryDirectory() as d:  # ssl loads a chain from files only
            for name, pem in (("key", key), ("chain", chain)):
                with open(os.open(os.path.join(d, name), os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                    f.write(pem)
            context.load_cert_chain(os.path.join(d, "chain"), os.path.join(d, "key"))
        return context


def certificate(cert_file: str | None, key_file: str | None) -> Certificate | None:
    """The daemon's :class:`Certificate` from its flags; None: plaintext."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise DpexConfigError("TLS needs both --tls-cert and --tls-key")
    return Certificate(cert_file, key_file)


def server_credentials(cert: Certificate | None) -> grpc.ServerCredentials | None:
    """TLS for a daemon's port from ``cert`` (None: plaintext), its files read
    again for a new connection once they changed."""
    if cert is None:
        return None
    version, (key, chain) = cert.current()
    seen = [version]

    def fetch() -> grpc.ServerCertificateConfiguration | None:  # gRPC asks at each handshake
        version, (key, chain) = cert.current()
        if version == seen[0]:
            return None  # unchanged: the configuration in use stays
        seen[0] = version
        return grpc.ssl_server_certificate_configuration([(key, chain)])

    return grpc.dynamic_ssl_server_credentials(grpc.ssl_server_certificate_configuration([(key, chain)]), fetch)


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

    def __init__(self, tokens: Tokens | str) -> None:
        self._tokens = tokens if isinstance(tokens, Tokens) else Tokens(tokens)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        return self._check(details, continuation(details))

    def _check(self, details: grpc.HandlerCallDetails, handler: Any) -> Any:
        if details.method.startswith("/grpc.health."):
            return handler
        given = dict(details.invocation_metadata or ()).get(_KEY, "")
        if self._tokens.accepts(given.encode()):
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
    def __init__(self, tokens: Tokens) -> None:
        self._tokens = tokens

    def _details(self, details: Any) -> Any:
        metadata = list(details.metadata or []) + [(_KEY, f"Bearer {self._tokens.current()}")]
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


def with_token(channel: grpc.Channel, token: Tokens | str | None) -> grpc.Channel:
    """The channel, sending the token (a daemon's :class:`Tokens`: its current one) with every call
    (unchanged when None)."""
    if not token:
        return channel
    return grpc.intercept_channel(channel, _AddToken(token if isinstance(token, Tokens) else Tokens(token)))
