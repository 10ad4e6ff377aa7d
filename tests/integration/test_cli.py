"""The command-line tools, run as a user runs them."""
import json
import os
import signal
import subprocess

import pytest

import dpex
from dpex.testing import status_tables as tables, test_cluster, wait_until
from tests.integration.commands import command, run


@pytest.mark.parametrize("cmd,words", [
    (["dpex-dispatcher"], ["--port", "DPEX_PORT", "--heartbeat-timeout", "DPEX_HEARTBEAT_TIMEOUT"]),
    (["dpex-worker"], ["--dispatcher", "DPEX_DISPATCHER", "--processes", "DPEX_PROCESSES", "Example"]),
    (["dpex", "status"], ["--dispatcher", "DPEX_DISPATCHER"]),
    (["dpex", "health"], ["--service", "--tls-ca", "--tls-server-name", "DPEX_TLS_SERVER_NAME"]),
])
def test_help(cmd, words):
    out = run(*cmd, "--help")
    assert out.returncode == 0
    for word in words:
        assert word in out.stdout
    from dpex import version
    out = run(cmd[0], "--version")  # every command says what it is
    assert out.returncode == 0 and out.stdout == f"{cmd[0]} {version.describe().removeprefix('dpex ')}\n"


def test_health_says_serving_or_why_not(cluster):
    """`dpex health`: the daemons' gRPC health as a probe (exit 0: SERVING) for compose and Kubernetes."""
    for address, service in ((cluster.address, "dpex.v1.Dispatcher"), (cluster.worker_addresses[0], "dpex.v1.Worker")):
        for args in ((), ("--service", service)):
            out = run("dpex", "health", address, *args)
            assert out.returncode == 0 and out.stdout == "SERVING\n", out.stderr
    out = run("dpex", "health", cluster.address, "--service", "dpex.v1.Worker")
    assert out.returncode == 1 and f"{cluster.address} serves no service 'dpex.v1.Worker'" in out.stderr
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        out = run("dpex", "health", f"127.0.0.1:{s.getsockname()[1]}", "--timeout", "1")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_status_at_a_workers_port_says_it_is_not_a_dispatcher(cluster):
    out = run("dpex", "status", "--dispatcher", cluster.worker_addresses[0])
    assert out.returncode != 0
    assert (f"dispatcher {cluster.worker_addresses[0]} does not serve this call (Method not found!): is that "
            "address really a Dpex dispatcher's?") in out.stderr


def test_status_shows_workers_and_delivered_batches(cluster):
    with dpex.RemoteDataLoader(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=12),
                               batch_size=4, job_name="status-demo", timeout=30) as dl:
        assert len(list(dl)) == 3
    out = run("dpex", "status", "--dispatcher", cluster.address)
    assert out.returncode == 0, out.stderr
    assert "WORKERS (2 alive, 0 lost, 0 left)" in out.stdout
    got = tables(out.stdout)
    assert sorted(w["ADDRESS"] for w in got["WORKERS"]) == sorted(cluster.worker_addresses)
    assert {w["STATE"] for w in got["WORKERS"]} == {"alive"}
    from dpex import version
    assert {w["DPEX/TORCH"] for w in got["WORKERS"]} == {f"{version.package()}/{version.torch()}"}
    assert f"({version.package()}/{version.torch()})" in out.stdout.splitlines()[0]  # the dispatcher's own
    # Workers report their load with each heartbeat: the 3 batches were produced and sent.
    wait_until(lambda: sum(int(w["SENT"]) for w in tables(run(
        "dpex", "status", "--dispatcher", cluster.address).stdout)["WORKERS"]) >= 3, 30, "loads reported")
    job = next(j for j in got["JOBS"] if j["NAME"] == "status-demo")
    assert (job["CONSUMERS"], job["PLANNED"], job["DELIVERED"], job["DONE"]) == ("0 active / 1", "3", "3", "100%")
    # The flag also comes from the environment; --json gives the same figures.
    from_env = run("dpex", "status", env={"DPEX_DISPATCHER": cluster.address}).stdout
    # This job's row (the cluster's earlier jobs may be collected meanwhile: it is the session's)
    assert [j for j in tables(from_env)["JOBS"] if j["NAME"] == "status-demo"] == [job]
    as_json = json.loads(run("dpex", "status", "--dispatcher", cluster.address, "--json").stdout)
    job = next(j for j in as_json["jobs"] if j["name"] == "status-demo")
    assert (job["batchesPlanned"], job["batchesDelivered"]) == ("3", "3")


def test_status_of_an_unreachable_dispatcher():
    out = run("dpex", "status", "--dispatcher", "127.0.0.1:1", "--timeout", "0.5")
    assert out.returncode == 1 and "cannot reach dispatcher 127.0.0.1:1" in out.stderr


def test_worker_with_a_wrong_dispatcher_exits_with_a_clear_error():
    out = run("dpex-worker", "--dispatcher", "127.0.0.1:1", "--connect-timeout", "0.5", "--processes", "1")
    assert out.returncode == 1 and "cannot reach dispatcher 127.0.0.1:1" in out.stderr
    assert "Check that the dispatcher runs" in out.stderr and "--connect-timeout" in out.stderr  # the fix
    out = run("dpex-worker", "--dispatcher", "127.0.0.1:1", "--data-path", "/nonexistent/dpex")
    assert out.returncode == 1 and "has no /nonexistent/dpex: copy the data there" in out.stderr
    out = run("dpex-worker", env={"DPEX_DISPATCHER": "no-port"})
    assert out.returncode == 1 and "HOST:PORT" in out.stderr


def test_bad_flag_values_are_reported():
    out = run("dpex-dispatcher", "--heartbeat-timeout", "0.1", "--heartbeat-interval", "1")
    assert out.returncode == 1 and "heartbeat_timeout_s must exceed heartbeat_interval_s" in out.stderr
    out = run("dpex-dispatcher", "--port", "http")
    assert out.returncode == 2 and "is not a valid integer" in out.stderr


def test_dispatcher_reads_its_port_from_the_environment(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([command("dpex-dispatcher"), "--ready-file", str(ready)],
                            env={**os.environ, "DPEX_PORT": "0", "DPEX_HOST": "127.0.0.1"},
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(ready.exists, 30, "the dispatcher to serve")
        address = ready.read_text()
        assert address.startswith("127.0.0.1:") and address != "127.0.0.1:0"
        assert "WORKERS (0 alive, 0 lost, 0 left)" in run("dpex", "status", "--dispatcher", address).stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert "shutting down" in proc.stderr.read()


def test_a_second_dispatcher_on_a_port_in_use_exits_with_a_clear_error(cluster):
    # The dispatcher's servers share their port (SO_REUSEPORT): a second one
    # must not quietly join them and take half the connections.
    port = cluster.address.rsplit(":", 1)[1]
    out = run("dpex-dispatcher", "--host", "127.0.0.1", "--port", port)
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr
    out = run("dpex-dispatcher", "--host", "0.0.0.0", "--port", port)
    assert out.returncode == 1 and "Address already in use (another dispatcher there?)" in out.stderr
    out = run("dpex", "status", "--dispatcher", cluster.address)
    assert out.returncode == 0 and "WORKERS (" in out.stdout  # the first one serves on


def test_a_killed_worker_is_shown_as_lost():
    with test_cluster(num_workers=2) as c:
        victim = c.kill_worker(0)

        def lost():
            out = run("dpex", "status", "--dispatcher", c.address).stdout
            return next((l for l in out.splitlines() if victim.address in l and " lost " in l), None)
        wait_until(lost, 30, "the worker to be marked lost")


def test_status_tells_epochs_drained_workers_and_live_jobs():
    with test_cluster(num_workers=2) as c:
        squares = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=12)
        done = dpex.RemoteDataLoader(c.address, squares, batch_size=4, job_name="done", timeout=30)
        for _ in range(3):  # epochs 0, 1, 2
            assert len(list(done)) == 3
        idle = dpex.RemoteDataLoader(c.address, squares, batch_size=4, job_name="idle", timeout=30)
        assert len(list(idle)) == 3
        running = dpex.RemoteDataLoader(c.address, squares, batch_size=1, job_name="running", timeout=30)
        it = iter(running)
        next(it)
        done.close()
        drained = c.kill_worker(0, signal.SIGTERM)
        out = run("dpex", "status", "--dispatcher", c.address).stdout
        got = tables(out)
        assert "WORKERS (1 alive, 0 lost, 1 left)" in out and "JOBS (1 running, 1 idle, 1 finished)" in out
        row = next(w for w in got["WORKERS"] if w["ADDRESS"] == drained.address)
        assert (row["STATE"], row["BUSY"], row["RUNNING"]) == ("left", "-", "-")  # no stale load
        jobs = {j["NAME"]: j for j in got["JOBS"]}
        assert (jobs["done"]["STATE"], jobs["done"]["EPOCH"]) == ("finished", "2")
        assert (jobs["idle"]["STATE"], jobs["idle"]["EPOCH"]) == ("idle", "0")
        assert (jobs["running"]["STATE"], jobs["running"]["CONSUMERS"]) == ("running", "1 active / 1")
        del it
        running.close(), idle.close()


def test_a_burst_of_sigterms_stops_a_daemon(tmp_path):
    # Ray's actor dying sends the parent-death SIGTERM while ray.kill and a
    # supervisor send theirs: a handler run inside another must not deadlock.
    for attempt in range(5):
        ready = tmp_path / f"ready-{attempt}"
        proc = subprocess.Popen([command("dpex-dispatcher"), "--port", "0", "--host", "127.0.0.1",
                                 "--ready-file", str(ready)], stderr=subprocess.DEVNULL)
        try:
            wait_until(ready.exists, 30, "the dispatcher to serve")
            for _ in range(2000):
                os.kill(proc.pid, signal.SIGTERM)
            assert proc.wait(30) == 0
        finally:
            proc.kill()
            proc.wait()


def test_a_failure_names_the_flags_set_from_the_environment(tmp_path):
    """Issue 55: DPEX_PORT is read by both daemons; a worker started in the dispatcher's shell fails to
    bind its port, and now says where the port came from."""
    import socket
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        out = subprocess.run([command("dpex-worker"), "--dispatcher", "127.0.0.1:1",
                              "--connect-timeout", "1"], env={**os.environ, "DPEX_PORT": str(port),
                                                              "DPEX_HOST": "127.0.0.1"},
                             capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert out.returncode == 1 and f"--port={port} from $DPEX_PORT" in out.stderr, out.stderr[-2000:]


def test_with_json_logs_a_fatal_start_up_error_is_one_json_line():
    """A log pipeline that parses JSON lines gets a daemon's last words too: a flag click refuses, a
    value the config refuses, an unreachable dispatcher."""
    cases = [(("dpex-dispatcher", "--log-format", "json", "--port", "http"), 2, "dpex.dispatcher", "not a valid integer"),
             (("dpex-dispatcher", "--log-format=json", "--heartbeat-timeout", "0.1", "--heartbeat-interval", "1"), 1,
              "dpex.dispatcher", "heartbeat_timeout_s must exceed"),
             (("dpex-worker", "--dispatcher", "127.0.0.1:1", "--connect-timeout", "0.3", "--processes", "1"), 1,
              "dpex.worker", "cannot reach dispatcher 127.0.0.1:1")]
    for args, code, logger, words in cases:
        out = run(*args, env={"DPEX_LOG_FORMAT": "json"})
        assert out.returncode == code, out.stderr
        last = json.loads(out.stderr.strip().splitlines()[-1])
        assert last["level"] == "critical" and last["logger"] == logger and words in last["msg"], last
    out = run("dpex-dispatcher", "--port", "http", unset=("DPEX_LOG_FORMAT",))  # text: click's own words
    assert out.returncode == 2 and "Error: Invalid value for '--port'" in out.stderr
