"""Authentication: a shared token on every call between trainers, the
dispatcher and workers; shipped code only from authenticated or loopback peers."""
import itertools
import os
import socket
import subprocess

import grpc
import pytest

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.version import versions
from dpex.proto import worker_pb2 as wpb
from dpex.rpc import CHANNEL_OPTIONS, channel
from dpex.testing import wait_until
from tests.integration import commands
from tests.integration.commands import command

TOKEN = "s3cret-token"
SPEC = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=8)


@pytest.fixture(scope="module")
def secured():
    with dpex.testing.test_cluster(num_workers=1, auth_token=TOKEN) as c:
        yield c


def run(*args, env=None):
    return commands.run(*args, env=env, unset=("DPEX_AUTH_TOKEN",))


def test_the_right_token_works_end_to_end(secured):
    with dpex.RemoteDataLoader(secured.address, SPEC, batch_size=4, auth_token=TOKEN, timeout=30) as dl:
        assert [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", ""])
def test_no_or_a_wrong_token_is_refused(secured, token, monkeypatch):
    monkeypatch.delenv("DPEX_AUTH_TOKEN", raising=False)
    with pytest.raises(dpex.DpexAuthError, match="missing or wrong auth token"):
        dpex.RemoteDataLoader(secured.address, SPEC, auth_token=token, connect_timeout=1)


def test_the_token_from_the_environment(secured, monkeypatch):
    monkeypatch.setenv("DPEX_AUTH_TOKEN", TOKEN)
    with dpex.RemoteDataLoader(secured.address, SPEC, batch_size=8, timeout=30) as dl:
        assert len(list(dl)) == 1


def test_every_worker_method_checks_it(secured):
    worker = secured.worker_addresses[0]
    with grpc.insecure_channel(worker, options=CHANNEL_OPTIONS) as ch:
        inspect = ch.unary_unary("/dpex.v1.Worker/Inspect", request_serializer=wpb.InspectRequest.SerializeToString,
                                 response_deserializer=wpb.InspectResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            inspect(wpb.InspectRequest(job_id=1), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        fetch = ch.stream_stream("/dpex.v1.Worker/Fetch", request_serializer=wpb.FetchRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            list(fetch(iter([wpb.FetchRequest(job_id=1)]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_status_and_a_worker_without_the_token(secured, tmp_path):
    out = run("dpex", "status", "--dispatcher", secured.address, "--timeout", "1")
    assert out.returncode == 1 and "missing or wrong auth token" in out.stderr
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    assert run("dpex", "status", "--dispatcher", secured.address, "--auth-token-file", str(token_file)).returncode == 0
    out = run("dpex-worker", "--dispatcher", secured.address, "--processes", "1", "--connect-timeout", "1")
    assert out.returncode == 1 and "missing or wrong auth token" in out.stderr


def host_ip():
    """This machine's address on a non-loopback interface, if it has one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") else ip


@pytest.mark.skipif(host_ip() is None, reason="no non-loopback interface")
@pytest.mark.parametrize("allow", [False, True])
def test_without_a_token_jobs_come_only_from_loopback(tmp_path, allow):
    ready = tmp_path / "ready"
    args = [command("dpex-dispatcher"), "--host", "0.0.0.0", "--port", "0", "--ready-file", str(ready)]
    proc = subprocess.Popen(args + (["--allow-unauthenticated"] if allow else []), stderr=subprocess.PIPE, text=True,
                            env={k: v for k, v in os.environ.items() if k != "DPEX_AUTH_TOKEN"})
    try:
        wait_until(ready.exists, 30, "the dispatcher")
        port = ready.read_text().rsplit(":", 1)[1]
        # Jobs carry code for the workers; workers' batches are unpickled by trainers.
        calls = [("GetOrCreateJob", dpb.GetOrCreateJobRequest(job=dpb.JobDef(dataset=b"x", num_consumers=1)),
                  dpb.GetOrCreateJobResponse, "job_id"),
                 ("RegisterWorker", dpb.RegisterWorkerRequest(versions=versions(), address="127.0.0.1:9"), dpb.RegisterWorkerResponse,
                  "worker_id")]
        for (method, request, response, field), (address, accepted) in itertools.product(
                calls, ((f"127.0.0.1:{port}", True), (f"{host_ip()}:{port}", allow))):
            with channel(address) as ch:
                stub = ch.unary_unary(f"/dpex.v1.Dispatcher/{method}", request_serializer=type(request).SerializeToString,
                                      response_deserializer=response.FromString)
                if accepted:
                    assert getattr(stub(request, timeout=10), field)
                else:
                    with pytest.raises(grpc.RpcError) as info:
                        stub(request, timeout=10)
                    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert "only from loopback peers" in info.value.details()
        if not allow:  # (an allowed worker would start and serve)
            out = run("dpex-worker", "--dispatcher", f"{host_ip()}:{port}", "--processes", "1",
                      "--connect-timeout", "1")
            assert out.returncode == 1 and "without authentication" in out.stderr
    finally:
        proc.terminate()
        proc.wait(30)
    assert ("accepted from anywhere" if allow else "accepted from loopback peers only") in proc.stderr.read()


def test_health_checks_answer_without_a_token(secured):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    for address, service in [(secured.address, "dpex.v1.Dispatcher"),
                             (secured.worker_addresses[0], "dpex.v1.Worker")]:
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                got = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert got.status == health_pb2.HealthCheckResponse.SERVING


def test_only_a_jobs_loaders_touch_its_epochs_definition_and_batches():
    # Issue 61: any peer could read a job's definition (GetJob), ack or cancel a trainer's epoch
    # (SyncConsumer, ReleaseConsumer with client_id=0), read its batches from a worker (Fetch with a job id
    # from `dpex status`) and deregister workers. Every such call now needs the job's (worker's) key.
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.proto import worker_pb2_grpc as wgrpc
    from tests.integration.test_observability import scrape, total
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)
    with dpex.testing.test_cluster(num_workers=1, metrics=True) as c, \
            dpex.RemoteDataLoader(c.address, spec, batch_size=2, job_name="victim", timeout=30) as dl:
        it = iter(dl)
        got = next(it)["y"].tolist()
        stub = dgrpc.DispatcherStub(channel(c.address))
        victim = dict(job_id=dl.job_id, consumer_index=0, epoch=0)
        forged = [lambda: stub.GetJob(dpb.GetJobRequest(job_id=dl.job_id), timeout=10),
                  lambda: stub.SyncConsumer(dpb.SyncConsumerRequest(**victim, delivered_seqs=list(range(20))),
                                            timeout=10),
                  lambda: stub.ReleaseConsumer(dpb.ReleaseConsumerRequest(**victim), timeout=10),
                  lambda: stub.SubmitPlan(dpb.SubmitPlanRequest(**victim, job_key=b"0" * 16, num_streams=1),
                                          timeout=10)]
        worker = wgrpc.WorkerStub(channel(c.worker_addresses[0]))
        forged += [lambda: worker.Inspect(wpb.InspectRequest(job_id=dl.job_id), timeout=10),
                   lambda: list(worker.Fetch(iter([wpb.FetchRequest(**victim, seq=5)]), timeout=10))]
        for call in forged:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
            assert f"names job {dl.job_id} without its key" in refused.value.details()
        status = stub.GetStatus(dpb.GetStatusRequest(), timeout=10)
        (w,) = status.workers
        with pytest.raises(grpc.RpcError) as refused:
            stub.DeregisterWorker(dpb.DeregisterWorkerRequest(worker_id=w.worker_id), timeout=10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        got += [y for batch in it for y in batch["y"].tolist()]
        assert got == list(range(40))  # the victim's epoch, whole
        assert total(scrape(c.dispatcher.metrics_url), "dpex_refused_calls_total", reason="job key") == 4
        assert total(scrape(c.dispatcher.metrics_url), "dpex_refused_calls_total", reason="worker key") == 1
        assert total(scrape(c.workers[0].metrics_url), "dpex_worker_refused_calls_total", reason="job key") == 2
        assert "refused a call from ipv4:127.0.0.1" in open(c.dispatcher.log_path).read()
        shown = run("dpex", "status", "--dispatcher", c.address)
        assert "calls refused: 4 for job key, 1 for worker key" in shown.stdout, shown.stdout + shown.stderr
        assert stub.GetStatus(dpb.GetStatusRequest(), timeout=10).workers[0].state == "alive"


def test_a_loader_that_joined_a_job_cannot_take_another_loaders_consumer_with_client_id_0(cluster):
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=2, job_name="held-by-its-loader", timeout=30) as dl:
        it = iter(dl)
        got = next(it)["y"].tolist()
        stub = dgrpc.DispatcherStub(channel(cluster.address))
        key = dl._session.job_key  # as any loader of that name and settings gets it from GetOrCreateJob
        with pytest.raises(grpc.RpcError) as refused:
            stub.SyncConsumer(dpb.SyncConsumerRequest(job_id=dl.job_id, job_key=key, consumer_index=0, epoch=0,
                                                      delivered_seqs=list(range(20)), client_id=0), timeout=10)
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS and "in use by another loader" in \
            refused.value.details()
        stub.ReleaseConsumer(dpb.ReleaseConsumerRequest(job_id=dl.job_id, job_key=key, consumer_index=0, epoch=0,
                                                        client_id=0), timeout=10)  # answered, and nothing done
        got += [y for batch in it for y in batch["y"].tolist()]
    assert got == list(range(40))


def _daemon(tmp_path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """A daemon started as an operator does; (its process, its address)."""
    ready = tmp_path / f"{name}.ready"
    log = open(tmp_path / f"{name}.log", "w")
    env = {k: v for k, v in os.environ.items() if k not in ("DPEX_AUTH_TOKEN", "DPEX_PORT")}
    proc = subprocess.Popen([command(name), "--port", "0", "--ready-file", str(ready), *args], env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60, name)
    assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-2000:]
    return proc, ready.read_text().splitlines()[0]


def test_a_token_is_rotated_with_no_restart_and_a_worker_refused_says_not_serving(tmp_path):
    """Each daemon's token file lists the new token beside the old, then the new alone: the daemons read it
    again when it changes (or at once on SIGHUP), trainers with either token are served while both are
    listed, and a worker whose token the dispatcher no longer takes answers NOT_SERVING until its file has it."""
    import signal
    dispatcher_tokens, worker_tokens = tmp_path / "dispatcher-token", tmp_path / "worker-token"
    dispatcher_tokens.write_text("old-token\n")
    worker_tokens.write_text("old-token\n")
    dispatcher, address = _daemon(tmp_path, "dpex-dispatcher", "--host", "127.0.0.1", "--auth-token-file",
                                  str(dispatcher_tokens), "--heartbeat-interval", "0.3")
    worker = None
    try:
        worker, worker_address = _daemon(tmp_path, "dpex-worker", "--dispatcher", address, "--host", "127.0.0.1",
                                         "--processes", "1", "--auth-token-file", str(worker_tokens),
                                         "--heartbeat-interval", "0.3")

        def served(token: str) -> bool:
            try:
                with dpex.RemoteDataLoader(address, SPEC, batch_size=4, auth_token=token, timeout=30) as dl:
                    return [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            except dpex.DpexAuthError:
                return False

        def health(worker_address=worker_address) -> str:
            return run("dpex", "health", worker_address, "--service", "dpex.v1.Worker").stdout.strip()

        assert served("old-token") and not served("new-token")
        dispatcher_tokens.write_text("old-token\nnew-token\n")  # read again on change: no signal
        worker_tokens.write_text("old-token\nnew-token\n")
        wait_until(lambda: served("new-token"), 30, "the new token taken")
        assert served("old-token")  # both, while both are listed
        dispatcher_tokens.write_text("new-token\n")  # the worker still sends the old one: refused
        wait_until(lambda: health() == "NOT_SERVING", 30, "the refused worker to say so")
        worker_tokens.write_text("new-token\n")
        worker.send_signal(signal.SIGHUP)  # at once
        wait_until(lambda: health() == "SERVING", 30, "the worker taken again")
        assert served("new-token") and not served("old-token")
        assert worker.poll() is None and dispatcher.poll() is None  # SIGHUP reloads, it does not stop
    finally:
        for proc in (worker, dispatcher):
            if proc is not None:
                proc.terminate()
                proc.wait(30)
