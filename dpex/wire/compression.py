"""Payload compression, chosen per job (``RemoteDataLoader(compression=...)``):
off by default; "lz4" (fast, modest ratio) or "zstd" (level 1) where the
link, not the CPU, limits throughput — see benchmarks/compression.py."""
from __future__ import annotations

from typing import Any

from dpex.errors import DpexConfigError, DpexWireError

CODECS = ("lz4", "zstd")


def check(name: str | None) -> str:
    """The codec's name ("" for none); a clear error if unknown or not installed."""
    if not name:
        return ""
    if name not in CODECS:
        raise DpexConfigError(f"compression must be None, 'lz4' or 'zstd', got {name!r}")
    try:
        _module(name)
    except ImportError as e:
        raise DpexConfigError(f"compression={name!r} needs the {e.name} package") from None
    return name


def _module(name: str) -> Any:
    if name == "lz4":
        import lz4.block
        return lz4.block
    import zstandard
    return zstandard


def compress(name: str, parts: list) -> bytes:
    data = b"".join(parts)
    if name == "lz4":
        return _module(name).compress(data, store_size=False)
    return _module(name).ZstdCompressor(level=1).compress(data)


def decompress(name: str, payload: Any, raw_size: int) -> bytes:
    if name not in CODECS:
        raise DpexWireError(f"unknown payload codec {name!r}")
    try:
        if name == "lz4":
            out = _module(name).decompress(payload, uncompressed_size=raw_size)
        else:
            out = _module(name).ZstdDecompressor().decompress(payload, max_output_size=raw_size)
    except Exception as e:  # each library has its own error types
        raise DpexWireError(f"corrupt {name} payload: {e}") from None
    if len(out) != raw_size:
        raise DpexWireError(f"{name} payload decompressed to {len(out)} bytes, expected {raw_size}")
    return out
