"""The client's own small modules: LoaderOptions (checked before anything
starts) and decode (frame -> batch: header, compression, hand-off files)."""
import pytest
import torch

from dpex import shm
from dpex.client import decode
from dpex.client.options import LoaderOptions
from dpex.errors import DpexConfigError
from dpex.proto import worker_pb2 as wpb
from dpex.wire import encode_parts, frame_parts, parse_frame
from dpex.wire.compression import compress


@pytest.mark.parametrize("kwargs,words", [
    (dict(address="http://x:1"), "HOST:PORT"),
    (dict(batch_size=0.5), "batch_size should be a positive integer value"),
    (dict(num_consumers=0), "num_consumers must be an integer >= 1"),
    (dict(num_consumers=2, consumer_index=2), "consumer_index must be in 0..1"),
    (dict(timeout_s=0), "timeout must be > 0 seconds"),
    (dict(window=0), "window must be >= 1"),
    (dict(num_workers=True), "num_workers must be >= 0"),
    (dict(num_workers=-1), "num_workers must be >= 0"),
    (dict(processes=0), "processes must be >= 1 or None"),
    (dict(connect_timeout_s=-1), "connect_timeout must be >= 0"),
    (dict(compression="gzip"), "compression"),
    (dict(seed=1.5), "seed must be an integer or None"),
])
def test_bad_options_are_refused_naming_the_argument(kwargs, words):
    with pytest.raises(DpexConfigError, match=words):
        LoaderOptions(**kwargs)


def test_good_options_keep_their_values():
    opts = LoaderOptions(address="dpex://h:1", batch_size=None, num_consumers=3, consumer_index=2, timeout_s=1.5,
                         compression="lz4")
    assert (opts.batch_size, opts.consumer_index, opts.compression) == (None, 2, "lz4")


def test_every_setting_of_the_loader_defaults_to_its_options_default():
    """LoaderOptions is the one source of defaults: RemoteDataLoader's signature takes them from it."""
    import inspect as pyinspect
    from dpex.client.loader import RemoteDataLoader
    params = pyinspect.signature(RemoteDataLoader.__init__).parameters
    renamed = {"timeout_s": "timeout", "connect_timeout_s": "connect_timeout", "start_method": None}
    for field, default in LoaderOptions.__dataclass_fields__.items():
        name = renamed.get(field, field)
        if name is None or name in ("num_consumers", "consumer_index"):  # derived from torch.distributed
            continue
        assert params[name].default == default.default, name


def frame(batch, compression=""):
    meta = wpb.Batch(job_id=1, seq=3)
    parts = encode_parts(batch)
    if compression:
        meta.raw_size, meta.compression = sum(memoryview(p).nbytes for p in parts), compression
        parts = [compress(compression, parts)]
    return b"".join(frame_parts(meta, parts))


@pytest.mark.parametrize("compression", ["", "lz4", "zstd"])
def test_a_frame_decodes_to_its_batch(compression):
    batch = {"x": torch.arange(12.0).reshape(3, 4), "y": [1, "a", None]}
    meta, payload = parse_frame(frame(batch, compression))
    assert meta.seq == 3
    out = decode.batch(meta, payload)
    assert torch.equal(out["x"], batch["x"]) and out["y"] == batch["y"]


def test_a_hand_off_file_is_mapped_in_place_of_the_payload_and_no_other_file_is(tmp_path):
    directory = shm.make_dir()
    if directory is None:
        pytest.skip("no writable /dev/shm")
    try:
        sent = shm.write(directory, "f-1", [frame({"x": torch.ones(1000)})], b"", 1)
        assert sent is not None
        meta, payload = decode.mapped(wpb.Batch(shm_path=sent.path, shm_size=sent.size))
        assert torch.equal(decode.batch(meta, payload)["x"], torch.ones(1000))
        del meta, payload
        with pytest.raises(FileNotFoundError):
            decode.mapped(wpb.Batch(shm_path=f"{directory}/gone", shm_size=10))
        (tmp_path / "f").write_bytes(b"x" * 10)
        with pytest.raises(OSError, match="not a dpex hand-off file"):
            decode.mapped(wpb.Batch(shm_path=str(tmp_path / "f"), shm_size=10))
    finally:
        shm.remove_dir(directory)
