"""A daemon's address, ``HOST:PORT``: the one rule for what trainers are
given, workers register and the CLIs take (no gRPC here: the dispatcher's
core checks a worker's address with it too)."""
from __future__ import annotations

from dpex import errors


def check_address(address: str) -> str:
    """``HOST:PORT`` (``dpex://HOST:PORT`` too), or a DpexConfigError at once."""
    text = address.strip() if isinstance(address, str) else ""
    if text.startswith("dpex://"):
        text = text[len("dpex://"):].rstrip("/")
    host, _, port = text.rpartition(":")
    bad = "://" in text or "/" in text or not host or not (port.isascii() and port.isdigit()) \
        or not 0 < int(port) < 65536 or (host.startswith("[") != host.endswith("]")) \
        or any(c.isspace() or not c.isprintable() for c in host)
    if bad:
        raise errors.DpexConfigError(
            f"bad address {address!r}: expected HOST:PORT (e.g. 127.0.0.1:7070 or dispatcher:7070), "
            "without a scheme or path")
    return text
