"""Frame -> batch in the trainer (its header parsed once, by dpex.client.streams): a same-host worker's
hand-off file mapped in place of the payload (no copy), decompression, and the
zero-copy decode. Each step raises DpexWireError for bytes that do not decode;
what to do then (ask again, fail the epoch) is the fetcher's policy."""
from __future__ import annotations

from typing import Any

from dpex.proto import worker_pb2 as wpb
from dpex.wire import decode, parse_frame
from dpex.wire.compression import decompress
from dpex.wire.frame import frame_view
from dpex import shm


def mapped(meta: wpb.Batch) -> tuple[wpb.Batch, Any]:
    """The frame a hand-off header points to, mapped from its file. OSError as
    mapping raises it (PermissionError: another user's file; FileNotFoundError:
    gone with its worker)."""
    return parse_frame(shm.map_frame(meta.shm_path, meta.shm_size, meta.shm_offset))


def batch(meta: wpb.Batch, payload: Any) -> Any:
    """The batch a payload holds, decompressed first if the job compresses."""
    if meta.compression:
        payload = decompress(meta.compression, frame_view(payload), meta.raw_size)
    return decode(payload)
