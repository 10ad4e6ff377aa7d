"""Where a loader's ``head_address`` leads: a Dpex dispatcher, a Ray
cluster, or an embedded local cluster, told apart before anything starts.

- ``"auto"``: ``$DPEX_DISPATCHER`` if set; else the Ray cluster this machine
  belongs to (``$RAY_ADDRESS``, or a local Ray node that ``ray start`` left
  its address for and that answers); else an embedded local cluster.
- ``"ray://HOST:PORT"``: a Ray cluster through Ray Client.
- ``"dpex://HOST:PORT"``: a Dpex dispatcher.
- ``"HOST:PORT"``: asked with the gRPC health check: a Dpex dispatcher
  answers for its service (a Dpex worker's address is refused, naming the
  mistake); any other gRPC server there (a Ray head's GCS) is taken for a
  Ray cluster; nothing answering is taken for a dispatcher not up yet (the
  loader waits ``connect_timeout`` for it, as before).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import grpc

from dpex.errors import DpexConfigError
from dpex.address import check_address
from dpex.rpc import answers_tcp, channel

log = logging.getLogger("dpex.launch")

DISPATCHER_ENV = "DPEX_DISPATCHER"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
DISPATCHER_SERVICE = "dpex.v1.Dispatcher"
WORKER_SERVICE = "dpex.v1.Worker"


@dataclass(frozen=True)
class Head:
    """What a head address means. ``kind``: "dispatcher", "ray" or "embedded";
    ``address``: the dispatcher's HOST:PORT, the Ray address, or None;
    ``why``: how it was chosen, for the log."""
    kind: str
    address: str | None
    why: str


def announce(message: str, *args: object) -> None:
    """Logs where a loader's workers are, visibly: through the application's
    logging if it set any up, else on stderr (as Ray does for its own)."""
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    log.info(message, *args)


def ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def local_ray_address() -> str | None:
    """The GCS address of a Ray node running on this machine: the one
    ``ray start`` (or ray.cluster_utils) wrote to Ray's address file, if a
    server accepts connections there."""
    root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"  # where Ray keeps it
    try:
        with open(os.path.join(root, "ray", "ray_current_cluster")) as f:
            address = f.read().strip()
    except OSError:
        return None
    return address if answers_tcp(address, 1.0) else None  # a node that has stopped leaves its file behind


def what_answers(address: str, token: str | None, tls_ca: bytes | None, timeout_s: float = 3.0) -> str | None:
    """"dispatcher" or "worker" (a Dpex daemon answers the health check for
    its service at ``address``), "other" (a gRPC server without either), or
    None (nothing answers)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    ch = channel(address, token, tls_ca)
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        for kind, service in (("dispatcher", DISPATCHER_SERVICE), ("worker", WORKER_SERVICE)):
            try:
                stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
                return kind
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    return None
        return "other"  # UNIMPLEMENTED, NOT_FOUND: a gRPC server without a Dpex service
    finally:
        ch.close()


def choose(head_address: str | None, token: str | None = None, tls_ca: bytes | None = None) -> Head:
    """What ``head_address`` names (see the module's docstring); a
    DpexConfigError for a malformed one, or a Ray address without Ray."""
    if head_address is None or head_address == "auto":
        head = _auto()
    elif not isinstance(head_address, str):
        raise DpexConfigError(f"head_address must be a string, got {type(head_address).__name__}")
    elif head_address.startswith("ray://"):
        head = Head("ray", head_address, "given")
    elif head_address.startswith("dpex://"):
        head = Head("dispatcher", check_address(head_address), "given")
    else:
        address = check_address(head_address)
        answer = what_answers(address, token, tls_ca)
        if answer == "worker":
            raise DpexConfigError(f"{address} is a Dpex worker, not the dispatcher: give the dispatcher's "
                                  "address (the --dispatcher its workers were started with)")
        head = Head("ray", address, "given; it answers gRPC but is not a Dpex dispatcher") if answer == "other" \
            else Head("dispatcher", address, "given")
    if head.kind == "ray" and not ray_installed():
        raise DpexConfigError(
            f"{head.address} is a Ray cluster ({head.why}), but Ray is not installed here: "
            "pip install 'dpex[ray]' (or give a Dpex dispatcher's address, dpex://HOST:PORT)")
    return head


def _auto() -> Head:
    if os.environ.get(DISPATCHER_ENV):
        return Head("dispatcher", check_address(os.environ[DISPATCHER_ENV]), f"${DISPATCHER_ENV}")
    if os.environ.get(RAY_ADDRESS_ENV):
        return Head("ray", os.environ[RAY_ADDRESS_ENV], f"${RAY_ADDRESS_ENV}")
    local = local_ray_address()
    if local is not None:
        if ray_installed():
            return Head("ray", local, "the Ray node running on this machine")
        log.warning("a Ray node runs on this machine (%s), but Ray is not installed in this environment: "
                    "loading on an embedded local cluster instead (pip install 'dpex[ray]' to use Ray)", local)
    return Head("embedded", None, f"no ${DISPATCHER_ENV}, no Ray cluster")


def resolve(address: str | None, token: str | None, tls_ca: bytes | None,
            given_token: str | None = None) -> tuple[str | None, str | None, str]:
    """(the dispatcher's HOST:PORT, or None for an embedded cluster; the
    token to send; for an embedded cluster chosen by ``"auto"``, why, which
    the loader says once the cluster serves: a loader built and dropped
    unused names none) for what a loader's ``address`` names. On a Ray
    cluster Dpex is found or started there, and its token is sent unless the
    loader was ``given_token``."""
    if address is None:
        return None, token, ""
    head = choose(address, token, tls_ca)
    if head.kind == "dispatcher":
        if address == "auto":  # a choice made for the user is said; a dispatcher they named is not
            announce("loading on the Dpex dispatcher at %s (%s)", head.address, head.why)
        return head.address, token, ""
    if head.kind == "embedded":
        return None, token, f"head_address={address!r}: {head.why}"
    from dpex.launch.ray import start
    endpoint = start(head.address)
    announce("loading on the Ray cluster at %s (%s): Dpex dispatcher %s, workers on %d nodes",
             head.address, head.why, endpoint.address, len(endpoint.workers))
    return endpoint.address, given_token or endpoint.auth_token, ""
