"""deploy/compose, the docker-compose deployment, without Docker (no engine
runs here; `make test-docker` runs the test harness's docker/docker-compose.yml
with a real one): the files as compose reads them, checked as data (restart
policies, healthchecks, /dev/shm sized to what the worker's flags let it
keep, every DPEX_ variable one the daemons read, the metrics ports
published), and run: each service's command and environment on a host of
its own (dpex.testing.compose), its healthcheck passing, a trainer on a
third host getting an epoch exactly once with the token, plaintext and with
the TLS override."""
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap

import pytest

from dpex.auth import TOKEN_ENV
from dpex.testing import compose, kube, netns, wait_until
from dpex.testing.nodes import write_node_data
from dpex.testing.pki import write_pki

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy", "compose")
FILES = {"plain": ["docker-compose.yml"], "tls": ["docker-compose.yml", "docker-compose.tls.yml"]}
SAMPLES = 60
TRAINER = textwrap.dedent("""
    import json
    import dpex
    spec = dpex.DatasetSpec("dpex.testing.datasets:NodeFiles", {samples}, 0.0, root="$DPEX_DATA_PATH")
    with dpex.RemoteDataLoader("dispatcher:7070", spec, batch_size=4, timeout=120) as dl:
        got = list(dl)
    print("RESULT " + json.dumps({{"order": [int(i) for b in got for i in b["i"]],
                                   "nodes": sorted({{n for b in got for n in b["node"]}})}}))
""")


def load(variant: str, directory: str = DEPLOY, **env: str) -> dict:
    return compose.load([os.path.join(directory, f) for f in FILES[variant]],
                        {"DPEX_ADVERTISE_HOST": "10.0.0.2", "DPEX_DISPATCHER_HOST": "dispatcher", **env})


@pytest.mark.parametrize("variant", FILES)
def test_the_files_restart_check_health_size_shm_and_use_only_flags_the_daemons_read(variant, monkeypatch):
    from dpex.cmd.dispatcher import main as dispatcher_cli
    from dpex.cmd.status import health
    from dpex.cmd.worker import main as worker_cli
    project = load(variant)
    for name, cli, binary in (("dispatcher", dispatcher_cli, "dpex-dispatcher"), ("worker", worker_cli, "dpex-worker")):
        service = project["services"][name]
        assert service["restart"] == "unless-stopped" and service["init"] is True
        assert compose.command(service) == [binary]
        env = compose.environment(service)
        envvars = {p.envvar for p in cli.params if p.envvar} | {TOKEN_ENV}
        assert {k for k in env if k.startswith("DPEX_")} <= envvars
        for key in [k for k in os.environ if k.startswith("DPEX_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        params = cli.make_context(binary, []).params  # every variable parses
        assert f"{params['metrics_port']}:{params['metrics_port']}" in service["ports"]
        assert f"{params['port']}:{params['port']}" in service["ports"]
        assert env["DPEX_AUTH_TOKEN_FILE"] == "/run/secrets/dpex-token" and service["secrets"] == ["dpex-token"]
        argv = compose.probe(service)["exec"]["command"]
        assert argv[:2] == ["dpex", "health"] and argv[2] == f"localhost:{params['port']}"
        health.make_context("health", argv[2:])  # the healthcheck's flags exist
        assert f"dpex.v1.{name.capitalize()}" in argv
        if variant == "tls":
            assert params["tls_cert"] and params["tls_key"] and (name == "dispatcher" or params["tls_ca"])
            assert "--tls-server-name" in argv
        if name == "worker":  # Docker's default /dev/shm (64 MB) would not hold what the flags allow
            kept = params["buffer_mb"] * 2**20 + params["share_cache_bytes"] + params["sample_cache_bytes"]
            assert compose.size(service["shm_size"]) >= kept + 512 * 2**20
    with pytest.raises(KeyError, match="DPEX_ADVERTISE_HOST"):  # as compose refuses it, naming what to set
        compose.load([os.path.join(DEPLOY, "docker-compose.yml")], {})


@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")
@pytest.mark.parametrize("variant", FILES)
def test_the_deployment_passes_its_healthchecks_and_serves_an_epoch_exactly_once(variant, tmp_path):
    tree = shutil.copytree(DEPLOY, tmp_path / "compose")
    token = secrets.token_hex(16)
    (tree / "secrets").mkdir()
    (tree / "secrets" / "token").write_text(token + "\n")
    data = tmp_path / "data"
    write_node_data(str(data), "worker", SAMPLES)
    trainer_env = {k: v for k, v in os.environ.items() if not k.startswith("DPEX_")}
    trainer_env[TOKEN_ENV] = token
    with kube.Pods({}, {}) as pods:
        worker_ip, dispatcher_ip = pods.host("worker"), pods.host("dispatcher")
        pods.host("trainer")
        pods.add_dns("dispatcher", dispatcher_ip)  # compose's network: services by name
        if variant == "tls":  # one certificate naming the dispatcher and the worker's advertised address
            (tree / "tls").mkdir()
            cert, key, ca = write_pki(tree / "tls", ["dispatcher"], [worker_ip])
            for name, path in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
                os.link(path, tree / "tls" / name)
            trainer_env["DPEX_TLS_CA"] = ca
        project = load(variant, str(tree), DPEX_ADVERTISE_HOST=worker_ip, DPEX_DATA_DIR=str(data),
                       DPEX_PROCESSES="1")
        running = {}
        for name, mounts in (("dispatcher", {"/var/lib/dpex": str(tmp_path / "journal")}), ("worker", {})):
            service = project["services"][name]
            spec, given = compose.workload(service, project, str(tree))
            running[name] = (pods.start(name, spec, {**given, **mounts}), compose.probe(service))
        for name, (pod, probe) in running.items():
            wait_until(lambda: pods.probe(pod, probe, "trainer") or pod.process.poll() is not None, 120,
                       f"{name}'s healthcheck")
            assert pod.process.poll() is None, pod.log()[-3000:]
        trainer = subprocess.run(["ip", "netns", "exec", pods.net.ns("trainer"), sys.executable, "-c",
                                  TRAINER.format(samples=SAMPLES)], env=trainer_env, capture_output=True,
                                 text=True, timeout=300)
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        result = json.loads(trainer.stdout.split("RESULT ", 1)[1])
        assert result == {"order": list(range(SAMPLES)), "nodes": ["worker"]}  # exactly once, from its copy
        worker, probe = running["worker"]
        took = pods.terminate(worker)  # docker stop: SIGTERM, then SIGKILL after stop_grace_period
        assert worker.process.returncode == 0 and took < worker.grace_s, worker.log()[-2000:]
        assert not pods.probe(worker, probe, "trainer")
