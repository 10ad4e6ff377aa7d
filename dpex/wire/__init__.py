"""Batch <-> bytes. Imports neither grpc nor the dispatcher."""
from dpex.wire.codec import decode, encode, encode_parts
from dpex.wire.frame import build_frame, frame_parts, parse_frame

__all__ = ["build_frame", "decode", "encode", "encode_parts", "frame_parts", "parse_frame"]
