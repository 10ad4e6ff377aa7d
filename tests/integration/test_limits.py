"""Size limits, open loaders and corrupt batch frames: each refused with a
clear error; a corrupt frame is asked for again, so a flaky worker loses
nothing; open loaders are bounded by --max-loaders, not by threads."""
import grpc
import pytest

import dpex
from dpex.config import WorkerConfig
from dpex.testing import test_cluster
from dpex.wire import frame_parts, parse_frame
from dpex.worker.server import WorkerServer
from dpex.worker.service import WorkerService
from tests.integration.test_observability import scrape, total

N, B = 48, 4
EXPECTED = [list(range(i, i + B)) for i in range(0, N, B)]


def squares(n=N, dim=3):
    return dpex.DatasetSpec("dpex.testing.datasets:Squares", n=n, dim=dim)


def test_a_batch_over_the_workers_message_limit_is_a_clear_error():
    # 4 x 20000 float32 per batch = 320 kB, over a 0.1 MiB limit.
    with test_cluster(num_workers=1, worker_flags=("--max-message-mb", "0.1")) as c:
        with dpex.RemoteDataLoader(c.address, squares(8, dim=20000), batch_size=4, timeout=30) as dl:
            with pytest.raises(dpex.DpexWorkerError, match=r"over this worker's message limit of 0.1 MiB") as e:
                list(dl)
        assert e.value.stage == "send"
        # The worker goes on serving batches that fit.
        with dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30) as dl:
            assert [b["y"].tolist() for b in dl] == EXPECTED


def test_plan_and_message_limits_of_the_dispatcher():
    flags = ("--max-plan-batches", "10", "--max-message-mb", "0.01")
    with test_cluster(num_workers=1, dispatcher_flags=flags) as c:
        with dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30) as dl:
            with pytest.raises(dpex.DpexConfigError, match="a plan of 12 batches is over this dispatcher's "
                                                           r"limit of 10 \(--max-plan-batches\)"):
                iter(dl)
        # An explicit plan (chunks of up to 2 MB): 8 batches of 2500 indices (~60 kB) are over 10 kB,
        # refused before any servicer runs. (Described plans are a few bytes.)
        with dpex.RemoteDataLoader(c.address, squares(20000), batch_size=2500, timeout=30,
                                   compact_plans=False) as dl:
            with pytest.raises(dpex.DpexConfigError, match="refused a message over its size limit"):
                iter(dl)
        with dpex.RemoteDataLoader(c.address, squares(40), batch_size=B, timeout=30) as dl:
            assert len(list(dl)) == 10  # still serving


def health(address: str) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="dpex.v1.Worker"), timeout=10).status


def test_a_worker_serves_more_than_128_open_loaders_and_answers_health_meanwhile():
    # Each loader keeps a Fetch stream open between epochs. On a server of 128 threads (one a stream)
    # loader 129 hung and health stopped answering (issue 61); streams are coroutines now.
    from grpc_health.v1 import health_pb2
    with test_cluster(num_workers=1, metrics=True) as c:
        loaders = []
        try:
            for i in range(140):
                dl = dpex.RemoteDataLoader(c.address, squares(8), batch_size=4, timeout=30)
                loaders.append(dl)
                assert [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # its stream stays open
            assert health(c.worker_addresses[0]) == health_pb2.HealthCheckResponse.SERVING
            m = scrape(c.workers[0].metrics_url)
            assert total(m, "dpex_worker_fetch_streams") == 140
            assert total(m, "dpex_worker_fetch_streams_limit") == WorkerConfig.max_loaders
            # Each still has its next epoch, over the streams kept.
            for dl in loaders[::20]:
                assert [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        finally:
            for dl in loaders:
                dl.close()


def test_a_loader_past_max_loaders_is_refused_at_once_and_the_refusal_counted():
    with test_cluster(num_workers=1, metrics=True, worker_flags=("--shm-min-kb", "0", "--max-loaders", "2")) as c:
        first = dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30)
        second = dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30)
        try:
            assert [b["y"].tolist() for b in first] == EXPECTED
            assert [b["y"].tolist() for b in second] == EXPECTED
            with dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=300) as third:
                with pytest.raises(dpex.DpexConfigError, match=r"serves at most 2 open loaders "
                                                               r"\(dpex-worker --max-loaders\)"):
                    list(third)  # at once, not after its timeout
            assert total(scrape(c.workers[0].metrics_url), "dpex_worker_fetch_refused_total") >= 1
            first.close()  # its place is free again
            with dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30) as fourth:
                assert [b["y"].tolist() for b in fourth] == EXPECTED
        finally:
            first.close()
            second.close()
        assert "refused a loader from" in open(c.workers[0].log_path).read()


def corrupting(how, count):
    """A WorkerService.Fetch that spoils the first ``count`` batch frames."""
    original = WorkerService.Fetch
    spoiled = []

    async def fetch(self, request_iterator, context):
        async for frame in original(self, request_iterator, context):
            meta, payload = parse_frame(frame)
            if len(payload) and len(spoiled) < count:
                spoiled.append(meta.seq)
                frame = how(frame, meta, payload)
            yield frame
    return fetch, spoiled


def truncated_frame(frame, meta, payload):
    return frame[:len(frame) - len(payload) // 2]  # the payload field says more than follows


def truncated_payload(frame, meta, payload):
    return b"".join(frame_parts(meta, [payload[:len(payload) // 2]]))  # a well-formed frame, bad payload


@pytest.fixture
def lying_worker(monkeypatch):
    """A real worker daemon, in this process, whose Fetch answers are spoiled."""
    servers = []

    def start(cluster, how, count):
        fetch, spoiled = corrupting(how, count)
        monkeypatch.setattr(WorkerService, "Fetch", fetch)
        servers.append(WorkerServer(WorkerConfig(dispatcher=cluster.address, host="127.0.0.1",
                                                 processes=1, heartbeat_interval_s=0.2)))
        return servers[-1], spoiled
    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("how", [truncated_frame, truncated_payload])
def test_corrupt_frames_are_asked_for_again(lying_worker, how):
    with test_cluster(num_workers=0) as c:
        _, spoiled = lying_worker(c, how, count=2)
        with dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30) as dl:
            assert [b["y"].tolist() for b in dl] == EXPECTED  # every batch once, in order
        assert len(spoiled) == 2


def test_a_worker_that_keeps_sending_corrupt_frames_fails_the_epoch_clearly(lying_worker):
    with test_cluster(num_workers=0) as c:
        server, _ = lying_worker(c, truncated_payload, count=10**6)
        with dpex.RemoteDataLoader(c.address, squares(), batch_size=B, timeout=30) as dl:
            with pytest.raises(dpex.DpexWireError, match=f"worker {server.address} sent 3 corrupt batch frames"):
                list(dl)
