"""Batch <-> bytes. Imports neither grpc nor the dispatcher; the codec (and
so torch) only when first used: the worker daemon moves frames, it does not
decode them."""
from typing import Any

from dpex.wire.frame import build_frame, frame_parts, parse_frame

__all__ = ["build_frame", "decode", "encode", "encode_parts", "frame_parts", "parse_frame"]


def __getattr__(name: str) -> Any:
    if name in ("decode", "encode", "encode_parts"):
        from dpex.wire import codec
        return getattr(codec, name)
    raise AttributeError(f"module 'dpex.wire' has no attribute {name!r}")
