"""The batch wire format: round trips, zero-copy decode, corrupt input."""
import collections
import dataclasses
import datetime
import decimal
import fractions
import math
import pickle
import threading

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dpex.errors import DpexWireError
from dpex.wire import decode, encode
from dpex.wire.codec import MAGIC

DTYPES = sorted({d for d in vars(torch).values()
                 if isinstance(d, torch.dtype) and not str(d).startswith(("torch.qint", "torch.quint"))}, key=str)
Point = collections.namedtuple("Point", "x y")


def _copyable(dtype) -> bool:
    try:
        torch.zeros(2, 2, dtype=torch.uint8).view(dtype).t().contiguous()
        return True
    except (NotImplementedError, RuntimeError):
        return False


COPYABLE = {d for d in DTYPES if d.itemsize >= 1 and _copyable(d)}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and a.contiguous().reshape(-1).view(torch.uint8).equal(
                    b.contiguous().reshape(-1).view(torch.uint8)) if a.numel() else
                isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape)
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, np.generic):
        return type(a) is type(b) and a.tobytes() == b.tobytes()
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 4), max_size=3))
    nbytes = max(1, math.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    raw = torch.tensor(list(draw(st.binary(min_size=nbytes, max_size=nbytes))), dtype=torch.uint8)
    t = raw[: math.prod(shape) * torch.empty((), dtype=dtype).element_size()].view(dtype).reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2 and dtype in COPYABLE:
        t = t.transpose(0, 1)  # non-contiguous
    return t


arrays = st.builds(lambda shape, dt, seed: np.random.default_rng(seed).integers(0, 100, shape).astype(dt),
                   st.lists(st.integers(0, 3), max_size=3),
                   st.sampled_from(["<f4", "<f8", "<i2", "|u1", "?", "<c16", "<M8[s]", ">i4"]),
                   st.integers(0, 1000))
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                    st.floats(allow_nan=True), st.text(max_size=20), st.binary(max_size=2000))
leaves = st.one_of(scalars, tensors(), arrays)
batches = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.lists(inner, max_size=4).map(tuple),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), inner, max_size=4),
    st.builds(Point, inner, inner)), max_leaves=12)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_round_trip(batch):
    assert same(batch, decode(encode(batch)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_torch_dtype(dtype):
    t = torch.zeros(3, 5, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else \
        torch.arange(15 * dtype.itemsize, dtype=torch.uint8).view(dtype).reshape(3, -1)
    out = decode(encode({"t": t, "empty": torch.empty(0, 2, dtype=dtype)}))
    assert same(t, out["t"]) and out["empty"].shape == (0, 2) and out["empty"].dtype == dtype


def test_special_tensors():
    base = torch.randn(4, 6, dtype=torch.complex64)
    cases = [base[:, ::2], base.conj(), torch.tensor(3.5), torch.ones(2, requires_grad=True) * 2,
             torch.randn(3).expand(4, 3), torch.tensor([True, False]), torch.randn(2, 3).bfloat16()]
    for t in cases:
        got = decode(encode(t))
        assert torch.equal(got, t.detach().resolve_conj()), t


def test_decode_does_not_copy_tensor_data():
    payload = encode({"a": torch.arange(1000, dtype=torch.float64), "n": np.ones(64, np.float32)})
    out = decode(payload)
    start = np.frombuffer(payload, np.uint8).ctypes.data
    for ptr, nbytes in [(out["a"].data_ptr(), 8000), (out["n"].ctypes.data, 256)]:
        assert start <= ptr and ptr + nbytes <= start + len(payload)


def _in_tensor(payload: bytes, pad: int) -> torch.Tensor:
    """The payload as a slice of a larger tensor, as a receive buffer holds it."""
    buf = torch.zeros(pad + len(payload) + 7, dtype=torch.uint8)
    buf[pad:pad + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return buf[pad:pad + len(payload)]


ALIGNED = (torch.uint8, torch.int16, torch.float32, torch.float64, torch.complex128)


@pytest.mark.parametrize("pad", [0, 64, 1, 6])
def test_a_tensor_payload_decodes_to_views_of_that_tensor(pad):
    batch = {str(t): torch.arange(24).to(t).reshape(2, 12) for t in ALIGNED}
    batch.update(n=np.arange(9, dtype="<f8"), b=b"x" * 5000, s="text", u=torch.tensor(3, dtype=torch.bfloat16))
    payload = _in_tensor(encode(batch), pad)
    out = decode(payload)
    assert same(batch, out)
    base = payload.untyped_storage().data_ptr()
    for dtype in ALIGNED:
        shared = out[str(dtype)].untyped_storage().data_ptr() == base
        assert shared == (pad % dtype.itemsize == 0), dtype  # copied only where a view cannot be aligned
    out["torch.float32"].add_(1)  # writable, and writes land in the payload's memory (a view)
    assert same(decode(payload)["torch.float32"], batch["torch.float32"] + 1) == (pad % 4 == 0)


def test_a_tensor_frame_parses_to_a_slice_of_itself():
    from dpex.proto import worker_pb2 as wpb
    from dpex.wire import build_frame, parse_frame
    from dpex.wire.frame import payload_offset
    payload = encode(torch.arange(100, dtype=torch.float32))
    frame = build_frame(wpb.Batch(job_id=7, seq=3, epoch=1), payload)
    tensor = _in_tensor(frame, 0)
    meta, part = parse_frame(tensor)
    start = payload_offset(frame[:40])
    assert (meta.job_id, meta.seq, meta.epoch) == (7, 3, 1) and isinstance(part, torch.Tensor)
    assert part.storage_offset() == start and bytes(part.numpy()) == payload
    assert payload_offset(frame[:start - 1]) is None  # the head ends before the payload: not known
    assert payload_offset(build_frame(wpb.Batch(job_id=7))) is None  # no payload


def test_decoded_tensors_are_usable_and_arrays_writable():
    out = decode(encode((torch.arange(6).reshape(2, 3), np.zeros(3))))
    out[0].add_(1)
    out[1][0] = 5.0
    assert out[0].sum().item() == 21 and out[1][0] == 5.0


def test_namedtuple_type_is_kept():
    out = decode(encode(Point(torch.tensor(1), "b")))
    assert type(out) is Point and out.y == "b"


def test_dict_key_types_and_order_are_kept():
    d = {3: 1, "a": 2, (1, 2): 3, None: 4}
    assert list(decode(encode(d)).items()) == list(d.items())


@pytest.mark.parametrize("value", [threading.Lock(), (i for i in range(3))], ids=lambda v: type(v).__name__)
def test_values_that_do_not_pickle_are_rejected_clearly(value):
    with pytest.raises(DpexWireError, match="cannot encode a value of type .* it does not pickle"):
        encode({"k": value})


@dataclasses.dataclass
class Labelled:
    image: torch.Tensor
    tags: set


class Image(torch.Tensor):
    pass


def _local_record():
    return collections.namedtuple("Local", "a b")


@pytest.mark.parametrize("value", [
    {1, 2}, fractions.Fraction(1, 3), decimal.Decimal("1.5"), datetime.date(2026, 1, 2), np.array([object(), 1]),
    torch.zeros(3).index_fill_(0, torch.tensor([1]), 2.0).to_sparse(), np.ma.masked_array([1, 2], mask=[0, 1]),
], ids=lambda v: type(v).__name__)
def test_any_picklable_value_travels_as_torch_s_workers_would_send_it(value):
    out = decode(encode({"k": [value]}))["k"][0]
    assert type(out) is type(value)
    if isinstance(value, torch.Tensor):
        assert out.layout == value.layout and torch.equal(out.to_dense(), value.to_dense())
    elif isinstance(value, np.ndarray):
        assert repr(out) == repr(value) if value.dtype != object else out[1] == 1
    else:
        assert out == value


def test_the_users_classes_come_back_as_themselves_with_tensors_out_of_band():
    image = torch.arange(1 << 16, dtype=torch.uint8)
    Local = _local_record()
    payload = encode([Labelled(image, {"cat"}), Local(np.arange(4), image), Image(torch.ones(2))])
    out = decode(payload)
    assert type(out[0]) is Labelled and out[0].tags == {"cat"} and torch.equal(out[0].image, image)
    assert type(out[1]) is Local and torch.equal(out[1].b, image) and out[1].a.tolist() == [0, 1, 2, 3]
    assert type(out[2]) is Image and out[2].tolist() == [1.0, 1.0]
    assert len(payload) < 3 * image.numel()  # the tensors are buffers of the payload, not in the pickle
    data = bytearray(payload)
    out = decode(data)  # a view of the payload, as outside a pickled value
    out[0].image[0] = 99
    assert bytes(data).count(bytes([99, 1, 2, 3, 4, 5])) == 1  # the payload's own bytes changed


def test_a_pickled_value_that_names_no_buffer_is_corrupt():
    header = msgpack.packb(["O", pickle.dumps(Point(1, 2)), []])
    assert decode(MAGIC + len(header).to_bytes(4, "little") + header) == Point(1, 2)

    class Refers(pickle.Pickler):
        def persistent_id(self, obj):
            return 3 if isinstance(obj, str) else None
    import io
    out = io.BytesIO()
    Refers(out).dump(["x"])
    header = msgpack.packb(["O", out.getvalue(), []])
    with pytest.raises(DpexWireError, match="corrupt batch payload: no buffer 3"):
        decode(MAGIC + len(header).to_bytes(4, "little") + header)


def test_no_imports_for_a_record_and_no_bare_pickle():
    with pytest.raises(DpexWireError):
        decode(pickle.dumps(Point(1, 2)))
    # A record naming a callable, or a module not yet imported, builds a plain record.
    for path in ["os:system", "antigravity:X"]:
        header = msgpack.packb(["P", path, ["x"], ["echo pwned"]])
        out = decode(MAGIC + len(header).to_bytes(4, "little") + header)
        assert isinstance(out, tuple) and out.x == "echo pwned"
    import sys
    assert "antigravity" not in sys.modules


@pytest.mark.parametrize("mutate", [
    lambda p: p[:3],                                    # too short
    lambda p: b"XXXX" + p[4:],                          # bad magic
    lambda p: p[:4] + (10 ** 6).to_bytes(4, "little") + p[8:],  # header length past the end
    lambda p: p[:200],                                  # truncated buffers
    lambda p: p[:8] + b"\xc1" + p[9:],                  # invalid msgpack
    lambda p: p.replace(b"<i2", b"(2,"),                 # a numpy descr numpy's parser takes for Python
])
def test_corrupt_payloads_raise_wire_errors(mutate):
    payload = encode({"a": torch.arange(100), "b": [1, 2], "c": np.arange(3, dtype="<i2")})
    with pytest.raises(DpexWireError, match="corrupt"):
        decode(mutate(payload))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_crash_the_decoder(data):
    try:
        decode(MAGIC + len(data).to_bytes(4, "little") + data)
        decode(data)
    except DpexWireError:
        pass
