"""gRPC plumbing shared by daemons and clients: channel options, the one
retry helper, and the one mapping between DpexError and gRPC status codes."""
from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import random
import socket
import threading
import time
from typing import Any, Callable, TypeVar

import grpc
from google.protobuf import message_factory

from dpex import errors
from dpex.address import check_address
from dpex.auth import AsyncTokenCheck, TokenCheck, Tokens, with_token
from dpex.latency import Latencies

log = logging.getLogger("dpex.rpc")

from dpex.config import MAX_MESSAGE_BYTES
from dpex.daemon import can_fork

# HTTP/2 flow control and frame size fixed, not tuned on the fly. With BDP
# probing on (grpc's default), a receiver re-announces SETTINGS_MAX_FRAME_SIZE
# from its bandwidth estimate as it goes, and grpc-core (seen with 1.85.1) can
# fail a healthy stream with "Frame size N is larger than max frame size M"
# when that setting shrinks while large DATA frames are in flight (19 MB
# batches on a fast loopback). Fixed: the largest frames HTTP/2 allows, a
# stream window that covers a batch, and no probe pings.
FLOW_OPTIONS = [
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.http2.lookahead_bytes", 64 << 20),
]

CONNECT_ATTEMPT_MS = 3_000

CHANNEL_OPTIONS = [
    *FLOW_OPTIONS,
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),  # dpex retries explicitly, see call()
    # A peer that comes back is found within a second: gRPC's default reconnect
    # backoff grows to 120 s, which kept workers away from a restarted dispatcher.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # Not the time between attempts but each attempt's least time to connect (gRPC's
    # MIN_CONNECT_TIMEOUT, 20 s by default): at 100 ms, a handshake slower than that
    # (a loaded host, a slow link, TLS far away) failed as UNAVAILABLE, and one over a
    # second (the backoff's cap) never succeeded. A peer that is cut off holds a new
    # call this long before it fails over.
    ("grpc.min_reconnect_backoff_ms", CONNECT_ATTEMPT_MS),
]


def server_options(max_receive_bytes: int) -> list[tuple[str, int]]:
    """A daemon's server options; requests over ``max_receive_bytes`` are
    refused with RESOURCE_EXHAUSTED before they reach a servicer."""
    return [
        *FLOW_OPTIONS,
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
    ]

_TO_STATUS: list[tuple[type[errors.DpexError], grpc.StatusCode]] = [
    (errors.DpexConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.DpexNotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.DpexConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.DpexTimeoutError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.DpexConnectionError, grpc.StatusCode.UNAVAILABLE),
    (errors.DpexWireError, grpc.StatusCode.DATA_LOSS),
    (errors.DpexAuthError, grpc.StatusCode.PERMISSION_DENIED),
]
_FROM_STATUS = {code: cls for cls, code in _TO_STATUS}


def status_of(exc: errors.DpexError) -> grpc.StatusCode:
    for cls, code in _TO_STATUS:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


# grpc's words for a TLS handshake that failed for good (no retry mends them), and what each means.
_TLS_REFUSALS = [
    ("CERTIFICATE_VERIFY_FAILED", "its certificate is not signed by the CA given (tls_ca=, --tls-ca or DPEX_TLS_CA)"),
    ("Hostname Verification Check failed", "its certificate does not name the host dialled: dial a name or IP it "
     "names, or give the name with --tls-server-name / DPEX_TLS_SERVER_NAME"),
    ("WRONG_VERSION_NUMBER", "it does not serve TLS: drop the CA, or start it with --tls-cert and --tls-key"),
]
# grpc's words when a plaintext client meets a TLS server (among other causes, so only a hint).
_PLAINTEXT_AT_TLS = "Socket closed"


def tls_refusal(details: str) -> str | None:
    """Why a TLS handshake failed for good, from grpc's details; None if it did not."""
    return next((why for words, why in _TLS_REFUSALS if words in details), None)


def tls_hint(details: str) -> str:
    """A hint to append when a connection failure may be a plaintext client at a TLS daemon."""
    if _PLAINTEXT_AT_TLS in details and "Tls" not in details:
        return " (if it serves TLS, give its CA: tls_ca=, --tls-ca or DPEX_TLS_CA)"
    return ""


def to_dpex_error(err: grpc.RpcError, target: str) -> errors.DpexError:
    """Turns an RPC failure into the DpexError the peer raised (or meant)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        why = tls_refusal(details)
        if why is not None:  # a configuration error, not an outage: said at once, not retried
            return errors.DpexAuthError(f"{target} failed TLS verification: {why} ({details})")
        return errors.DpexConnectionError(f"cannot reach {target}: {details}{tls_hint(details)}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.DpexTimeoutError(f"{target} did not answer in time: {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return errors.DpexAuthError(f"{target} refused us: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        if "larger than max" in details:  # grpc's own words
            return errors.DpexConfigError(f"{target} refused a message over its size limit: {details}")
        return errors.DpexConfigError(f"{target} refused: {details}")  # a limit of the peer's, it says which
    if code == grpc.StatusCode.UNIMPLEMENTED:  # e.g. a worker's port given for the dispatcher's
        return errors.DpexConfigError(
            f"{target} does not serve this call ({details}): is that address really a Dpex "
            f"{target.split()[0]}'s? (another daemon's port, e.g. a worker's for the dispatcher's, or "
            "another program)")
    cls = _FROM_STATUS.get(code, errors.DpexError)
    return cls(details)


F = TypeVar("F", bound=Callable[..., Any])


class Malformed:
    """A request that did not parse (see :func:`add_servicer`)."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.error = errors.DpexConfigError(f"malformed {type_name}: {error}")


def add_servicer(server: grpc.Server | grpc.aio.Server, servicer: Any, service: Any) -> None:
    """Registers ``servicer`` for ``service`` (a unary ServiceDescriptor), as
    the generated ``add_*Servicer_to_server`` does, except that a request that
    does not parse reaches the method as :class:`Malformed`, which
    :func:`servicer_method` answers with INVALID_ARGUMENT (a ``grpc.aio``
    server would say UNKNOWN)."""
    handlers = {}
    for method in service.methods:
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name), request_deserializer=parser(request_class),
            response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def parser(request_class: type) -> Callable[[bytes], Any]:
    """A request deserializer that turns what does not parse into :class:`Malformed`
    (answered INVALID_ARGUMENT by :func:`servicer_method`), not an exception (UNKNOWN)."""
    def parse(data: bytes) -> Any:
        try:
            return request_class.FromString(data)
        except Exception as e:  # DecodeError, or a field that is not valid UTF-8
            return Malformed(request_class.DESCRIPTOR.full_name, e)
    return parse


def _failure(fn: Callable, e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and details a servicer method's exception is answered with."""
    if isinstance(e, errors.DpexError):
        return status_of(e), str(e)
    log.exception("unexpected error in %s", fn.__name__)  # a bug: say so instead of a bare UNKNOWN
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


def _parsed(request: Any) -> Any:
    if isinstance(request, Malformed):
        raise request.error
    return request


def servicer_method(fn: F) -> F:
    """Maps DpexError raised in a servicer method (a coroutine too) to its
    status code, and a :class:`Malformed` request to INVALID_ARGUMENT."""
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def coroutine(*args: Any) -> Any:  # (self,) request, context
            try:
                return await fn(*args[:-2], _parsed(args[-2]), args[-1])
            except Exception as e:
                await args[-1].abort(*_failure(fn, e))
        return coroutine  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:  # (self,) request, context
        try:
            return fn(*args[:-2], _parsed(args[-2]), args[-1])
        except Exception as e:
            args[-1].abort(*_failure(fn, e))
    return wrapper  # type: ignore[return-value]


class Outage:
    """Since when a peer has been unreachable. Calls that share one retry for
    as long as the outage allows in all, not each from its own start (a
    trainer's end-of-epoch report and its next ``iter()`` give up together)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.since: float | None = None
        self._said = 0.0  # when the outage was last logged

    def failed(self, now: float) -> float:
        """Records a failed attempt; when the outage began (``now``: this is its first)."""
        with self._lock:
            if self.since is None:
                self.since = self._said = now
            return self.since

    def say_again(self, now: float, every_s: float = 30.0) -> bool:
        """Whether a long outage is due to be logged again (once per ``every_s``)."""
        with self._lock:
            if now - self._said < every_s:
                return False
            self._said = now
            return True

    def over(self, target: str) -> None:
        with self._lock:
            since, self.since = self.since, None
        if since is not None:  # its start was logged: so is its end
            log.warning("reached %s again after an outage of %.1fs", target, time.monotonic() - since)


_CLOSED = "Channel closed!"  # gRPC's words for a call cut short because this process closed its channel


def call(method: Callable[..., Any], request: Any, *, target: str, timeout_s: float,
         retry_for_s: float = 0.0, stop: Callable[[], bool] | None = None,
         track: Callable[[grpc.Future], None] | None = None, outage: Outage | None = None) -> Any:
    """Calls a unary RPC; retries UNAVAILABLE with backoff for ``retry_for_s``
    (counted from the start of ``outage``, if one is shared), saying so at the
    first failure: which peer, why, and for how long.

    A CANCELLED call that ``stop()`` did not ask for (the server cut it
    short as it stopped) is retried as UNAVAILABLE is. Any other failure, or
    running out of retry time, raises the DpexError that corresponds to the
    status. ``track`` receives the call's future, so that another thread can
    cancel it (it then raises DpexCancelledError), as does a closed channel.
    """
    outage = outage if outage is not None else Outage()
    delay = 0.05
    while True:
        try:
            future = method.future(request, timeout=timeout_s)
        except ValueError as e:  # "Cannot invoke RPC: Channel closed!": its owner is closing
            raise errors.DpexCancelledError(f"call to {target} was cancelled: {e}") from None
        if track is not None:
            track(future)
        try:
            result = future.result()
            outage.over(target)
            return result
        except grpc.FutureCancelledError:  # cancelled here, through ``track``
            raise errors.DpexCancelledError(f"call to {target} was cancelled") from None
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = (e.details() if hasattr(e, "details") else None) or ""
            if (code == grpc.StatusCode.CANCELLED and stop is not None and stop()) or _CLOSED in details:
                # Asked for, or our channel was closed under the call (its owner is closing): no outage.
                raise errors.DpexCancelledError(f"call to {target} was cancelled") from None
            # CANCELLED that we did not ask for: the server cut the call short (it was stopping), or our
            # channel closed (the next try says so): an outage like UNAVAILABLE, never a silent end.
            if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or tls_refusal(details):
                raise to_dpex_error(e, target) from None
            now = time.monotonic()
            since = outage.failed(now)  # read once: another call may end the outage meanwhile
            deadline = since + retry_for_s
            if now >= deadline or (stop and stop()) or _exiting:
                error = to_dpex_error(e, target)
                if retry_for_s > 0:
                    error.args = (f"{error} (unreachable for {now - since:.0f}s)",)
                raise error from None
            why = f"{details}{tls_hint(details)}" if details else code
            if since == now:  # the first failure of this outage
                log.warning("cannot reach %s (%s); retrying %s", target, why,
                            f"for {deadline - now:.0f}s" if deadline < math.inf else "until it is back")
            elif outage.say_again(now):
                log.warning("still cannot reach %s after %.0fs (%s); retrying %s", target, now - since, why,
                            f"for {deadline - now:.0f}s more" if deadline < math.inf else "until it is back")
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())) * random.uniform(0.5, 1.0))
        delay = min(delay * 2, 1.0)


_exiting = False           # the interpreter exits: an unreachable daemon is not waited for, nor said


def exiting() -> None:
    """The interpreter is exiting (its embedded daemons stop): a call that finds its daemon
    unreachable fails at once, quietly, instead of retrying until it is back."""
    global _exiting
    _exiting = True


_used = False              # this process made a gRPC channel: gRPC's threads run in it
_used_at_fork = False      # ... when it last forked
_forked_from_grpc = False  # this process is a fork of one where gRPC's threads ran


def _before_fork() -> None:
    global _used_at_fork
    _used_at_fork = _used and not can_fork()  # a channel made, its threads running


def _after_fork_in_child() -> None:
    global _forked_from_grpc, _used
    _forked_from_grpc, _used = _forked_from_grpc or _used_at_fork, False


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def check_usable() -> None:
    """Refuses at once in a process forked from one where Dpex had made a
    gRPC channel: gRPC would hang in it (issue 55)."""
    if _forked_from_grpc:
        raise errors.DpexConfigError(
            "this process was forked from one where Dpex had run (its gRPC threads), and gRPC hangs in such "
            "a child: start it with multiprocessing.get_context('spawn') (or 'forkserver'), as torch's "
            "DataLoader(multiprocessing_context=...) does, or make it before the parent's first Dpex loader")


def channel(address: str, token: Tokens | str | None = None, tls_ca: bytes | None = None,
            server_name: str | None = None) -> grpc.Channel:
    """A channel to a Dpex daemon, sending ``token`` with every call (a daemon's
    :class:`~dpex.auth.Tokens`: the current one); with
    ``tls_ca`` (PEM), over TLS, verifying the daemon against those CAs, under
    ``server_name`` if given (a probe reaching its own pod at localhost)."""
    global _used
    check_usable()
    _used = True
    address = check_address(address)
    if tls_ca:
        override = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        raw = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=tls_ca),
                                  options=CHANNEL_OPTIONS + override)
    else:
        raw = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    return with_token(raw, token)


def listen(server: grpc.Server, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Binds ``address`` (TLS with ``credentials``); the port, or a DpexConfigError."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials
                else server.add_insecure_port(address))
    except RuntimeError as e:
        raise errors.DpexConfigError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise errors.DpexConfigError(f"cannot listen on {address} (port in use?)")
    return port


def add_health(server: grpc.Server, service: str) -> Any:
    """The standard gRPC health service (for container and Kubernetes probes),
    SERVING for "" and ``service``; answers without a token."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", service):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


async def add_async_health(server: grpc.aio.Server, service: str) -> Any:
    """:func:`add_health` for a ``grpc.aio`` server (call it on the server's loop)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    for name in ("", service):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


class AsyncTimer(grpc.aio.ServerInterceptor):
    """Times each unary call's handler into ``latencies`` by method name
    (a sync handler stays sync: the server runs it in its thread pool)."""

    def __init__(self, latencies: Latencies) -> None:
        self._latencies = latencies

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.unary_unary is None:
            return handler  # a stream's life is not a latency
        inner, method = handler.unary_unary, details.method.rsplit("/", 1)[-1]
        observe = self._latencies.observe
        if inspect.iscoroutinefunction(inner):
            async def timed(request: Any, context: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await inner(request, context)
                finally:
                    observe(time.perf_counter() - start, method)
        else:
            def timed(request: Any, context: Any) -> Any:
                start = time.perf_counter()
                try:
                    return inner(request, context)
                finally:
                    observe(time.perf_counter() - start, method)
        return handler._replace(unary_unary=timed)


def server_interceptors(tokens: Tokens | str | None, aio: bool = False,
                        latencies: Latencies | None = None) -> list[grpc.ServerInterceptor]:
    """The token check (with a token), then, on a ``grpc.aio`` server with
    ``latencies``, the calls' timing (refused calls are not timed)."""
    checks: list[grpc.ServerInterceptor] = [(AsyncTokenCheck if aio else TokenCheck)(tokens)] if tokens else []
    return checks + ([AsyncTimer(latencies)] if aio and latencies is not None else [])


def answers_tcp(address: str, timeout_s: float) -> bool:
    """Something accepts TCP connections at HOST:PORT."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False
