"""Large batches over the gRPC data path: batches of 1-64 MiB, many times,
arrive intact with no stream failure (grpc-core's dynamic HTTP/2 frame size
once failed healthy streams: "Frame size N is larger than max frame size M")."""
import logging

import dpex
from dpex.rpc import CHANNEL_OPTIONS, server_options

SIZES = (1, 7, 19, 33, 64)


def test_http2_flow_control_is_fixed_on_both_sides():
    for options in (dict(CHANNEL_OPTIONS), dict(server_options(4 << 20))):
        assert options["grpc.http2.bdp_probe"] == 0  # no frame size re-announced mid-stream
        assert options["grpc.http2.max_frame_size"] == (1 << 24) - 1


def test_batches_of_1_to_64_mb_stream_without_a_failure(cluster, caplog):
    n = 60
    with caplog.at_level(logging.WARNING, logger="dpex.client"), \
            dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Sized", n, SIZES),
                                  batch_size=1, shared_memory=False, timeout=120) as loader:
        for i, batch in enumerate(loader):
            assert batch.shape == (1, SIZES[i % len(SIZES)] << 20)
            assert batch[0, 0] == batch[0, -1] == i % 251
        assert i == n - 1
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
