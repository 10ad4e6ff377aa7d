"""The batch wire format: a msgpack header plus raw, 64-byte aligned buffers.

Layout: ``b"DPX1" | u32 header length | header | pad | buffer | pad | buffer ...``.
The header is one msgpack value, the structure of the batch. A node is either a
plain msgpack scalar (None, bool, int in 64 bits, float, str, short bytes) or a
list whose first item is a tag:

  ["T", dtype, shape, offset, nbytes]   torch.Tensor
  ["N", descr, shape, offset, nbytes]   numpy.ndarray
  ["S", descr, raw]                     numpy scalar
  ["B", offset, nbytes]                 long bytes
  ["I", decimal]                        int beyond 64 bits
  ["L", [node...]] / ["U", [node...]]   list / tuple
  ["D", [[key, value]...]]              dict (any encodable keys, order kept)
  ["P", "module:qualname", [fields], [node...]]   namedtuple of a class found by import
  ["O", pickle, [node...]]             any other picklable value

Offsets count from the start of the data section. Tensors and arrays are views
into the payload, not copies, also inside an "O" value: its pickle refers to
them by their place in the node list (pickle's persistent ids), so only the
rest of the object is pickled. "O" is how a batch carries what torch's
DataLoader would carry (the user's own classes, a Fraction, a set): pickled
with cloudpickle on the worker, so that a class the trainer shipped by value
comes back as that very class, and unpickled in the trainer, which trusts its
workers as torch's DataLoader trusts its worker processes. A namedtuple whose
class is imported by name on both sides stays "P", which never imports.
"""
from __future__ import annotations

import collections
import io
import pickle
import struct
import sys
import warnings
from typing import Any, Callable

import msgpack
import numpy as np
import torch

from dpex.errors import DpexWireError
from dpex.wire import callables
from dpex.wire.frame import frame_view

MAGIC = b"DPX1"
ALIGN = 64
_PREFIX = struct.Struct("<4sI")
_INLINE_BYTES = 1024
_INT_MIN, _UINT_MAX = -(2 ** 63), 2 ** 64 - 1
_PAD = bytes(ALIGN)


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class _Encoder:
    def __init__(self, placed: Callable[[int, int], int | None] | None = None, start: int = 0) -> None:
        self.buffers: list[memoryview] = []
        self.offsets: list[int] = []
        self.size = _aligned(start)
        self.placed = placed  # a buffer's offset if it lies in the data section already (by address, size)

    def add(self, buf: memoryview) -> int:
        if self.placed is not None:
            at = self.placed(np.frombuffer(buf, dtype=np.uint8).ctypes.data, buf.nbytes)
            if at is not None:
                return at
        offset = self.size
        self.buffers.append(buf)
        self.offsets.append(offset)
        self.size = _aligned(offset + buf.nbytes)
        return offset

    def node(self, obj: Any) -> Any:
        if obj is None or isinstance(obj, (bool, float, str)):
            return obj
        if isinstance(obj, int):
            return obj if _INT_MIN <= obj <= _UINT_MAX else ["I", str(obj)]
        if _in_buffers(obj):
            return self.tensor(obj) if isinstance(obj, torch.Tensor) else self.array(obj)
        if isinstance(obj, np.generic) and not obj.dtype.hasobject:
            return ["S", np.lib.format.dtype_to_descr(obj.dtype), obj.tobytes()]
        if isinstance(obj, (bytes, bytearray, memoryview)):
            data = memoryview(obj).cast("B")
            if data.nbytes <= _INLINE_BYTES:
                return bytes(data)
            return ["B", self.add(data), data.nbytes]
        if isinstance(obj, dict):
            return ["D", [[self.node(k), self.node(v)] for k, v in obj.items()]]
        if isinstance(obj, tuple) and hasattr(obj, "_fields") and _imported(type(obj)):
            cls = type(obj)
            return ["P", f"{cls.__module__}:{cls.__qualname__}", list(obj._fields),
                    [self.node(v) for v in obj]]
        if type(obj) is tuple:
            return ["U", [self.node(v) for v in obj]]
        if type(obj) is list:
            return ["L", [self.node(v) for v in obj]]
        return self.pickled(obj)

    def pickled(self, obj: Any) -> list:
        nodes: list[Any] = []

        def out_of_band(value: Any) -> int | None:
            if _in_buffers(value):  # the pickle keeps only their place in ``nodes``
                nodes.append(self.node(value))
                return len(nodes) - 1
            return None
        try:
            data = callables.dumps(obj, persistent_id=out_of_band)
        except Exception as e:
            raise DpexWireError(
                f"cannot encode a value of type {type(obj).__module__}.{type(obj).__qualname__}: it does not "
                f"pickle ({type(e).__name__}: {e}); batches may hold tensors, arrays and any picklable "
                "value") from e
        return ["O", data, nodes]

    def tensor(self, t: torch.Tensor) -> list:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        try:
            t = t.resolve_conj().resolve_neg().contiguous()
        except (NotImplementedError, RuntimeError) as e:
            raise DpexWireError(f"cannot encode a non-contiguous {t.dtype} tensor: {e}") from e
        shape = list(t.shape)
        dtype = str(t.dtype).removeprefix("torch.")
        if t.numel() == 0:
            return ["T", dtype, shape, 0, 0]
        raw = t.reshape(-1).view(torch.uint8).numpy()
        data = memoryview(raw).cast("B")
        return ["T", dtype, shape, self.add(data), data.nbytes]

    def array(self, a: np.ndarray) -> list:
        shape = list(a.shape)  # ascontiguousarray turns 0-d into 1-d
        a = np.ascontiguousarray(a)
        descr = np.lib.format.dtype_to_descr(a.dtype)
        if a.nbytes == 0:
            return ["N", descr, shape, 0, 0]
        data = memoryview(a.reshape(-1).view(np.uint8)).cast("B")
        return ["N", descr, shape, self.add(data), data.nbytes]


def encode(obj: Any) -> bytes:
    """Encodes a batch (nested containers of tensors, arrays and scalars)."""
    return b"".join(encode_parts(obj))


def _head(enc: _Encoder, obj: Any) -> list[bytes]:
    """The payload's head: prefix, msgpack header of ``obj`` (its buffers
    added to ``enc``), padding to the data section."""
    header = msgpack.packb(enc.node(obj), use_bin_type=True)
    head_size = _PREFIX.size + len(header)
    return [_PREFIX.pack(MAGIC, len(header)), header, _PAD[: _aligned(head_size) - head_size]]


def encode_parts(obj: Any) -> list[Any]:
    """The payload as a list of buffers, to be joined once by the caller."""
    enc = _Encoder()
    parts: list[Any] = _head(enc, obj)
    for buf in enc.buffers:
        parts.append(buf)
        parts.append(_PAD[: _aligned(buf.nbytes) - buf.nbytes])
    return parts


def encode_placed(obj: Any, placed: Callable[[int, int], int | None],
                  start: int) -> tuple[list[bytes], list[tuple[int, memoryview]], int]:
    """The payload of a batch whose buffers mostly lie in its data section
    already (stacked there: dpex.worker.slabs): ``placed(address, nbytes)``
    gives such a buffer's offset in the section, else None; the others go
    from ``start`` on. Returns the payload's head (what precedes the data
    section), the other buffers with their offsets, and the section's size."""
    enc = _Encoder(placed, start)
    head = _head(enc, obj)
    copies = list(zip(enc.offsets, enc.buffers))
    return head, copies, max([start] + [offset + buf.nbytes for offset, buf in copies])


class _Decoder:
    def __init__(self, payload: Any, data_start: int, size: int) -> None:
        self.payload = payload
        self.data_start = data_start
        self.size = size  # the payload's bytes

    def raw(self, offset: int, nbytes: int, itemsize: int = 1) -> torch.Tensor:
        start = self.data_start + offset
        if offset < 0 or nbytes < 0 or start + nbytes > self.size:
            raise DpexWireError("corrupt batch payload: a buffer lies outside the payload")
        if not isinstance(self.payload, torch.Tensor):
            return torch.frombuffer(self.payload, dtype=torch.uint8, count=nbytes, offset=start)
        # A slice of the payload tensor shares its storage: pinned memory stays
        # pinned, and torch's caching host allocator sees the copies made from it.
        part = self.payload[start:start + nbytes]
        return part if part.storage_offset() % itemsize == 0 else part.clone()  # a view needs it aligned

    def node(self, n: Any) -> Any:
        if not isinstance(n, list):
            return n
        try:
            tag = n[0]
            if tag == "T":
                _, dtype_name, shape, offset, nbytes = n
                dtype = getattr(torch, dtype_name, None)
                if not isinstance(dtype, torch.dtype):
                    raise DpexWireError(f"corrupt batch payload: unknown dtype {dtype_name!r}")
                if nbytes == 0:
                    return torch.empty(shape, dtype=dtype)
                return self.raw(offset, nbytes, dtype.itemsize).view(dtype).reshape(shape)
            if tag == "N":
                _, descr, shape, offset, nbytes = n
                dtype = np.lib.format.descr_to_dtype(_descr(descr))
                if nbytes == 0:
                    return np.empty(shape, dtype=dtype)
                return self.raw(offset, nbytes).numpy().view(dtype).reshape(shape)
            if tag == "S":
                return np.frombuffer(n[2], dtype=np.lib.format.descr_to_dtype(_descr(n[1])))[0]
            if tag == "B":
                return self.raw(n[1], n[2]).numpy().tobytes()
            if tag == "I":
                return int(n[1])
            if tag == "L":
                return [self.node(v) for v in n[1]]
            if tag == "U":
                return tuple(self.node(v) for v in n[1])
            if tag == "D":
                return {_hashable(self.node(k)): self.node(v) for k, v in n[1]}
            if tag == "P":
                return _namedtuple(n[1], n[2])(*(self.node(v) for v in n[3]))
            if tag == "O":
                return self.unpickled(n[1], n[2])
        except DpexWireError:
            raise
        except Exception as e:  # numpy's dtype parser raises SyntaxError too (the fuzzer's find): any is corrupt
            raise DpexWireError(f"corrupt batch payload: {type(e).__name__}: {e}") from e
        raise DpexWireError(f"corrupt batch payload: unknown tag {tag!r}")


    def unpickled(self, data: bytes, nodes: list[Any]) -> Any:
        decoder = self

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, pid: Any) -> Any:
                if not isinstance(pid, int) or not 0 <= pid < len(nodes):
                    raise DpexWireError(f"corrupt batch payload: no buffer {pid!r} for a pickled value")
                return decoder.node(nodes[pid])
        try:
            return Unpickler(io.BytesIO(data)).load()
        except DpexWireError:
            raise
        except Exception as e:
            raise DpexWireError(f"a batch holds a value the trainer cannot unpickle: {type(e).__name__}: {e} "
                                "(its module or class must be importable here, or defined in the script)") from e


def _in_buffers(value: Any) -> bool:
    """A plain strided tensor or a plain array of values: its data travels as a
    buffer of the payload. Subclasses, sparse, quantized and object arrays are pickled."""
    if type(value) is torch.Tensor:
        return value.layout == torch.strided and not value.is_quantized and not value.is_meta
    return type(value) is np.ndarray and not value.dtype.hasobject


def _imported(cls: type) -> bool:
    """The class is what its module and qualified name find, in a module already imported."""
    obj: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


def _descr(d: Any) -> Any:
    # msgpack turns the tuples of a structured dtype's descr into lists.
    if isinstance(d, list):
        return [tuple(_descr(x) for x in field) for field in d]
    return d


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


def _namedtuple(path: str, fields: list[str]) -> type:
    module, _, qualname = path.partition(":")
    try:
        # Only a module the trainer already imported: a payload never triggers imports.
        obj: Any = sys.modules[module]
        for part in qualname.split("."):
            obj = getattr(obj, part)
        if isinstance(obj, type) and issubclass(obj, tuple) and list(obj._fields) == fields:
            return obj
    except Exception:  # not known here: rebuild an equivalent type
        pass
    return collections.namedtuple(qualname.rpartition(".")[2] or "Record", fields)


def decode(payload: bytes | bytearray | memoryview | torch.Tensor) -> Any:
    """Decodes a payload made by :func:`encode` (bytes, or a 1-D uint8 tensor);
    tensors share its memory."""
    view = frame_view(payload)
    if view.nbytes < _PREFIX.size:
        raise DpexWireError("corrupt batch payload: too short")
    magic, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise DpexWireError("corrupt batch payload: bad magic (not a Dpex batch)")
    end = _PREFIX.size + header_len
    if end > view.nbytes:
        raise DpexWireError("corrupt batch payload: truncated header")
    try:
        root = msgpack.unpackb(view[_PREFIX.size:end], raw=False, strict_map_key=False)
    except Exception as e:
        raise DpexWireError(f"corrupt batch payload: bad header: {e}") from e
    with warnings.catch_warnings():
        # The payload is ours alone; torch only warns that bytes are immutable.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return _Decoder(payload, _aligned(end), view.nbytes).node(root)
