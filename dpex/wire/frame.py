"""Batch frames: a serialized ``dpex.v1.Batch`` message built around an
already-encoded payload, and parsed without copying the payload.

Worker processes build the whole frame, so the worker daemon forwards bytes
and the trainer slices the payload out of the received message. A frame is
bytes, a buffer (a uint8 numpy array, ``dpex.client.buffers``) or a 1-D
uint8 torch tensor (pinned memory, ``dpex.client.pinning``); a tensor
frame's payload is a slice of the tensor itself. This module does not import torch.
"""
from __future__ import annotations

import sys
from typing import Any, Iterator

from dpex.errors import DpexWireError
from dpex.proto import worker_pb2 as wpb

_PAYLOAD_TAG = b"\x0a"  # field 1, wire type 2 (length-delimited)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DpexWireError("corrupt batch frame: bad varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def frame_parts(meta: wpb.Batch, payload_parts: list) -> list:
    """The pieces whose concatenation is ``meta`` with ``payload`` set."""
    return [*_field_head(meta.SerializeToString(), sum(memoryview(p).nbytes for p in payload_parts)),
            *payload_parts]


def _field_head(meta: bytes, payload_size: int) -> list[bytes]:
    """``meta`` (a serialized Batch), then the payload field's tag and size: what precedes the payload."""
    return [meta, _PAYLOAD_TAG, _varint(payload_size)]


def frame_head(meta: bytes, payload_head: list, data_size: int) -> bytes:
    """What precedes a payload's data section of ``data_size`` bytes in its
    frame: ``meta`` (a serialized Batch without payload), the payload's field
    tag and size, and ``payload_head``."""
    return b"".join([*_field_head(meta, sum(len(p) for p in payload_head) + data_size), *payload_head])


def build_frame(meta: wpb.Batch, payload: bytes = b"") -> bytes:
    return b"".join(frame_parts(meta, [payload]) if payload else [meta.SerializeToString()])


def is_tensor(frame: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor frame exists only where torch is loaded
    return torch is not None and isinstance(frame, torch.Tensor)


def frame_view(frame: Any) -> memoryview:
    """The bytes of a frame or payload of any kind, without a copy."""
    return memoryview(frame.numpy()) if is_tensor(frame) else memoryview(frame)


def _fields(view: memoryview) -> Iterator[tuple[int, int, int, int, int]]:
    """(field, wire type, start, value start, end) of each field of a
    serialized message; ``end`` may lie past ``view`` (a truncated field)."""
    pos = 0
    while pos < len(view):
        start = pos
        key, pos = _read_varint(view, pos)
        field, wire_type = key >> 3, key & 7
        value = pos
        if wire_type == 0:
            _, pos = _read_varint(view, pos)
        elif wire_type == 2:
            length, value = _read_varint(view, pos)
            pos = value + length
        elif wire_type in (1, 5):
            pos += 8 if wire_type == 1 else 4
        else:
            raise DpexWireError(f"corrupt batch frame: wire type {wire_type}")
        yield field, wire_type, start, value, pos


def payload_offset(head: Any) -> int | None:
    """Where the payload's bytes begin in a frame of which ``head`` is the
    start (None: not within ``head``, or no payload)."""
    try:
        for field, wire_type, _, value, _ in _fields(memoryview(head)):
            if field == 1 and wire_type == 2:
                return value
    except DpexWireError:  # the head ends inside a varint
        return None
    return None


def parse_frame(frame: Any) -> tuple[wpb.Batch, Any]:
    """Splits a frame into its metadata and a zero-copy view of the payload
    (for a tensor frame, a slice of that tensor)."""
    view = frame_view(frame)
    meta_parts, payload = [], view[0:0]
    for field, wire_type, start, value, end in _fields(view):
        if wire_type == 2 and end > len(view):
            raise DpexWireError("corrupt batch frame: truncated field")
        if field == 1 and wire_type == 2:
            payload = frame[value:end] if is_tensor(frame) else view[value:end]
        else:
            meta_parts.append(view[start:end])
    try:
        meta = wpb.Batch.FromString(b"".join(meta_parts))
    except Exception as e:
        raise DpexWireError(f"corrupt batch frame: {e}") from e
    return meta, payload


def error_of(frame: Any) -> wpb.RemoteError | None:
    """The error a frame carries instead of a batch (None: a batch, or a
    frame not in memory here, as a hand-off file's)."""
    if not isinstance(frame, (bytes, bytearray)):
        return None
    view = memoryview(frame)
    try:
        for field, wire_type, _, value, end in _fields(view):
            if field == 6 and wire_type == 2 and end <= len(view):
                return wpb.RemoteError.FromString(view[value:end])
    except Exception:  # noqa: BLE001 - not a frame this can read: not counted as an error
        return None
    return None
