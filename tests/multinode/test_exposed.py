"""A dispatcher and a worker without a token that listen on every interface
(issue 61): a peer on another host (network namespaces, real addresses) is
refused every call but health, each refusal counted by reason; on the
daemons' own host (loopback) the same calls reach the services."""
import os

import pytest

from dpex.auth import TOKEN_ENV
from dpex.testing import netns

pytestmark = pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")

# Every call of both services, once each: "NAME CODE" per line (OK when answered).
CALLS = r"""
import sys, grpc
from dpex.proto import dispatcher_pb2 as dpb, worker_pb2 as wpb
from dpex.rpc import channel
from dpex.version import versions
dispatcher, worker = sys.argv[1], sys.argv[2]
D, W = "/dpex.v1.Dispatcher/", "/dpex.v1.Worker/"
unary = [
    (dispatcher, "GetStatus", dpb.GetStatusRequest(), dpb.GetStatusResponse),
    (dispatcher, "GetOrCreateJob", dpb.GetOrCreateJobRequest(job=dpb.JobDef(dataset=b"x", num_consumers=1)),
     dpb.GetOrCreateJobResponse),
    (dispatcher, "GetJob", dpb.GetJobRequest(job_id=1), dpb.GetJobResponse),
    (dispatcher, "SubmitPlan", dpb.SubmitPlanRequest(job_id=1, num_streams=1), dpb.SubmitPlanResponse),
    (dispatcher, "SyncConsumer", dpb.SyncConsumerRequest(job_id=1), dpb.SyncConsumerResponse),
    (dispatcher, "ReleaseConsumer", dpb.ReleaseConsumerRequest(job_id=1), dpb.ReleaseConsumerResponse),
    (dispatcher, "RegisterWorker", dpb.RegisterWorkerRequest(address="10.0.0.9:1", versions=versions()),
     dpb.RegisterWorkerResponse),
    (dispatcher, "WorkerHeartbeat", dpb.WorkerHeartbeatRequest(worker_id="w-1"), dpb.WorkerHeartbeatResponse),
    (dispatcher, "DeregisterWorker", dpb.DeregisterWorkerRequest(worker_id="w-1"), dpb.DeregisterWorkerResponse),
    (dispatcher, "ReportWorker", dpb.ReportWorkerRequest(address="10.0.0.9:1"), dpb.ReportWorkerResponse),
    (worker, "Inspect", wpb.InspectRequest(job_id=1), wpb.InspectResponse),
]
for address, name, request, response in unary:
    with channel(address) as ch:
        stub = ch.unary_unary((W if address == worker else D) + name,
                              request_serializer=type(request).SerializeToString,
                              response_deserializer=response.FromString)
        try:
            stub(request, timeout=10)
            print(name, "OK", flush=True)
        except grpc.RpcError as e:
            print(name, e.code().name, e.details().replace("\n", " "), flush=True)
with channel(worker) as ch:
    fetch = ch.stream_stream(W + "Fetch", request_serializer=wpb.FetchRequest.SerializeToString)
    try:
        list(fetch(iter([wpb.FetchRequest(job_id=1)]), timeout=5))
    except grpc.RpcError as e:
        print("Fetch", e.code().name, e.details().replace("\n", " "), flush=True)
"""

STATUS = r"""
import sys
from dpex.proto import dispatcher_pb2 as dpb, dispatcher_pb2_grpc as dgrpc
from dpex.rpc import channel
with channel(sys.argv[1]) as ch:
    print(dict(dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10).refused_calls_total))
"""


def answers(output: str) -> dict[str, str]:
    return {line.split(" ", 1)[0]: line.split(" ", 2)[1] for line in output.splitlines() if line.strip()}


def test_a_peer_on_another_host_is_refused_every_call_without_a_token():
    with netns.NetnsCluster(workers=0, dispatcher=False) as hosts:
        ip, ready = hosts.nodes["dispatcher"], os.path.join(hosts.dir, "d.ready")
        no_token = {TOKEN_ENV: ""}
        hosts.procs["dispatcher"] = hosts._spawn("dispatcher", [
            "-m", "dpex.cmd.dispatcher", "--host", "0.0.0.0", "--port", "7070", "--ready-file", ready], no_token)
        hosts._await_ready("dispatcher", ready)
        ready = os.path.join(hosts.dir, "w.ready")
        hosts.procs["worker"] = hosts._spawn("dispatcher", [  # on the dispatcher's host: it may serve it
            "-m", "dpex.cmd.worker", "--dispatcher", "127.0.0.1:7070", "--host", "0.0.0.0", "--port", "7071",
            "--advertise-host", ip, "--processes", "1", "--ready-file", ready], no_token)
        hosts._await_ready("worker", ready)
        assert "WARNING" in hosts.log("dispatcher") and "auth: NONE" in hosts.log("dispatcher")

        remote = hosts.run("trainer", ["-c", CALLS, f"{ip}:7070", f"{ip}:7071"], timeout=120)
        got = answers(remote.stdout)
        assert len(got) == 12, remote.stdout + remote.stderr
        assert set(got.values()) == {"PERMISSION_DENIED"}, remote.stdout
        assert "only from loopback peers" in remote.stdout and "serves loopback peers only" in remote.stdout

        # On the daemons' host the calls reach the services (which say what is wrong with them instead).
        local = hosts.run("dispatcher", ["-c", CALLS, "127.0.0.1:7070", "127.0.0.1:7071"], timeout=120)
        assert "PERMISSION_DENIED" not in answers(local.stdout).get("GetStatus", "?"), local.stdout
        assert answers(local.stdout)["GetStatus"] == "OK" and answers(local.stdout)["RegisterWorker"] == "OK"
        counted = hosts.run("dispatcher", ["-c", STATUS, "127.0.0.1:7070"])
        assert counted.stdout.strip() == "{'not loopback': 10}", counted.stdout + counted.stderr
        assert f"refused a call from ipv4:{hosts.nodes['trainer']}" in hosts.log("dispatcher")

        # A loader on the other host gets the same answer at once, as an error that says what to do.
        loader = hosts.run("trainer", ["-c", (
            "import dpex, sys\n"
            "try:\n"
            "    dpex.RemoteDataLoader(sys.argv[1], dpex.DatasetSpec('dpex.testing.datasets:Squares', n=8), "
            "batch_size=4, timeout=30)\n"
            "except dpex.DpexAuthError as e:\n"
            "    print('refused:', e)\n"), f"{ip}:7070"], timeout=120)
        assert "refused:" in loader.stdout and "--auth-token-file" in loader.stdout, loader.stdout + loader.stderr
