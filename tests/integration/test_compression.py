"""Payload compression per job: the same batches, whatever the codec and path."""
import pytest
import torch

import dpex
from dpex.testing import test_cluster
from dpex.wire.compression import compress, decompress

N, B = 48, 4


@pytest.fixture(scope="module")
def shm_cluster():
    with test_cluster(num_workers=2) as c:  # every batch through /dev/shm (same-host or not)
        yield c


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["same-host", "grpc"])
def test_compressed_jobs_deliver_the_same_batches(shm_cluster, codec, shared_memory):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=N, dim=1000)
    with dpex.RemoteDataLoader(shm_cluster.address, spec, batch_size=B, timeout=30, shuffle=True, seed=3) as plain:
        want = [b["x"] for b in plain]
    with dpex.RemoteDataLoader(shm_cluster.address, spec, batch_size=B, timeout=30, shuffle=True, seed=3,
                               compression=codec, shared_memory=shared_memory) as packed:
        got = [b["x"] for b in packed]
        # Squares' rows are ramps: they compress, so fewer bytes arrive than the plain job's.
        assert packed.stats().bytes_received < 0.75 * plain.stats().bytes_received
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_unknown_codec_and_conflicting_jobs_are_clear_errors(shm_cluster):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=N)
    with pytest.raises(dpex.DpexConfigError, match="compression must be None, 'lz4' or 'zstd', got 'gzip'"):
        dpex.RemoteDataLoader(shm_cluster.address, spec, batch_size=B, compression="gzip")
    with dpex.RemoteDataLoader(shm_cluster.address, spec, batch_size=B, job_name="packed", compression="lz4"):
        with pytest.raises(dpex.DpexConflictError, match="different compression"):
            dpex.RemoteDataLoader(shm_cluster.address, spec, batch_size=B, job_name="packed")


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_corrupt_compressed_payloads_are_wire_errors(codec):
    data = compress(codec, [bytes(range(256)) * 64])
    assert decompress(codec, data, 256 * 64) == bytes(range(256)) * 64
    with pytest.raises(dpex.DpexWireError):
        decompress(codec, data[: len(data) // 2], 256 * 64)
    with pytest.raises(dpex.DpexWireError):
        decompress(codec, data, 256 * 64 + 1)
