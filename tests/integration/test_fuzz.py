"""Hostile input: random bytes on the raw ports, malformed protobuf to every
method, valid messages naming unknown jobs and workers, and a short run of
the fuzzer on every port (dpex.testing.fuzz; the 10^5-input runs:
benchmarks/fuzz.py). The daemons must answer with an error status (or drop
the connection), keep serving, and give a well-behaved client a correct
epoch afterwards."""
import random
import socket

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.rpc import CHANNEL_OPTIONS
from dpex.testing.fuzz import PORTS, run_fuzz
from dpex.version import versions

DISPATCHER_METHODS = ["RegisterWorker", "WorkerHeartbeat", "DeregisterWorker", "GetOrCreateJob", "GetJob",
                      "SubmitPlan", "SyncConsumer", "ReleaseConsumer", "GetStatus"]
TRIED = {"raw": 0, "protobuf": 0, "unknown ids": 0}


@pytest.fixture(scope="module")
def target():
    with dpex.testing.test_cluster(num_workers=1) as c:
        yield c
    print(f"\nfuzz inputs tried: {TRIED}, {sum(TRIED.values())} in all")


def raw_method(ch, service, method, streaming=False):
    make = ch.stream_stream if streaming else ch.unary_unary
    return make(f"/dpex.v1.{service}/{method}", request_serializer=None, response_deserializer=None)


def test_random_bytes_on_the_raw_ports(target):
    rng = random.Random(0)
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    for address in [target.address, *target.worker_addresses]:
        host, port = address.rsplit(":", 1)
        for i in range(100):
            payload = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4096)))
            with socket.create_connection((host, int(port)), timeout=5) as s:
                s.sendall((preface if i % 2 else b"") + payload)
                s.settimeout(2)
                try:
                    s.recv(65536)  # whatever the daemon answers, or it closes
                except (socket.timeout, ConnectionResetError):
                    pass
            TRIED["raw"] += 1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(method=st.sampled_from(DISPATCHER_METHODS + ["Inspect", "Fetch"]), body=st.binary(max_size=512))
def test_malformed_protobuf_gets_an_error_status(target, method, body):
    worker = method in ("Inspect", "Fetch")
    address = target.worker_addresses[0] if worker else target.address
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as ch:
        call = raw_method(ch, "Worker" if worker else "Dispatcher", method, streaming=method == "Fetch")
        try:
            # A second's deadline: an answer comes in milliseconds; a Fetch stream that
            # parsed is kept open (as a trainer's is) until its deadline.
            result = call(iter([body]), timeout=1) if method == "Fetch" else call(body, timeout=1)
            if method == "Fetch":  # a stream: read what comes (not_assigned frames) until the deadline
                for _ in result:
                    pass
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT,
                                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
                                grpc.StatusCode.PERMISSION_DENIED), e
    TRIED["protobuf"] += 1


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job=st.integers(0, 2 ** 64 - 1), worker=st.text(max_size=20), consumer=st.integers(0, 2 ** 32 - 1),
       epoch=st.integers(0, 2 ** 64 - 1), seqs=st.lists(st.integers(0, 2 ** 64 - 1), max_size=5))
def test_unknown_ids_get_a_clear_status(target, job, worker, consumer, epoch, seqs):
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    with grpc.insecure_channel(target.address) as ch:
        stub = dgrpc.DispatcherStub(ch)
        calls = [(stub.SyncConsumer, dpb.SyncConsumerRequest(job_id=job, consumer_index=consumer, epoch=epoch,
                                                            delivered_seqs=seqs, next_seq=seqs[0] if seqs else 0)),
                 (stub.SubmitPlan, dpb.SubmitPlanRequest(job_id=job, consumer_index=consumer, epoch=epoch)),
                 (stub.GetJob, dpb.GetJobRequest(job_id=job)),
                 (stub.WorkerHeartbeat, dpb.WorkerHeartbeatRequest(worker_id=worker, held_split_ids=seqs))]
        for method, request in calls:
            with pytest.raises(grpc.RpcError) as info:
                method(request, timeout=5)
            assert info.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
            assert info.value.details()
            TRIED["unknown ids"] += 1


@pytest.mark.parametrize("sampler", [dict(kind=9, batch_size=4), dict(kind=dpb.SamplerSpec.SHUFFLE, batch_size=0),
                                     dict(kind=dpb.SamplerSpec.DISTRIBUTED, batch_size=4, num_replicas=2, rank=5),
                                     dict(kind=dpb.SamplerSpec.SHUFFLE, batch_size=4, length=10)])
def test_a_sampler_description_no_sampler_makes_is_refused(target, sampler):
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)
    with dpex.RemoteDataLoader(target.address, spec, batch_size=4, timeout=30) as dl, \
            grpc.insecure_channel(target.address) as ch:
        request = dpb.SubmitPlanRequest(job_id=dl.job_id, consumer_index=0, epoch=7,
                                        sampler=dpb.SamplerSpec(**sampler))
        with pytest.raises(grpc.RpcError) as info:
            dgrpc.DispatcherStub(ch).SubmitPlan(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "describes" in info.value.details()


def test_the_daemons_still_serve_a_good_client(target):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)
    with dpex.RemoteDataLoader(target.address, spec, batch_size=4, shuffle=True, seed=1, timeout=30) as dl:
        got = [b["y"].tolist() for b in dl]
    assert sorted(y for b in got for y in b) == list(range(40)) and len(got) == 10
    assert [w.process.poll() for w in target.workers] == [None] and target.dispatcher.process.poll() is None


def test_a_worker_registering_an_address_that_is_not_host_port_is_refused_and_trainers_go_on(target):
    """The fuzzer's find: a RegisterWorker with a garbage address was taken, and
    every trainer then failed building a channel to it ("bad address")."""
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    with grpc.insecure_channel(target.address) as ch:
        for address in ["a0/.b. .0b:a0:a:0", "host:\u00b2", "a b:5", "dpex://127.0.0.1:5", "127.0.0.1:0"]:
            with pytest.raises(grpc.RpcError) as info:
                dgrpc.DispatcherStub(ch).RegisterWorker(
                    dpb.RegisterWorkerRequest(versions=versions(), address=address), timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "HOST:PORT" in info.value.details()
    test_the_daemons_still_serve_a_good_client(target)


def test_the_fuzzer_on_every_port_finds_nothing_and_a_job_runs_after_each():
    reports = run_fuzz(inputs=1500, seed=7)
    assert [r.port for r in reports] == list(PORTS)
    for r in reports:
        assert r.inputs >= 1000 and r.ok, f"{r}: {r.unhandled}"
