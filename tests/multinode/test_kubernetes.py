"""deploy/kubernetes must not drift from the code. No Kubernetes cluster can
run here, so this proves what it can without one: the kustomize base and
overlays render, every object is valid against the Kubernetes schema, the
CLIs take every flag and DPEX_* variable the manifests give them, and the
rendered containers' commands, args and env, run as pods on hosts of their
own (dpex.testing.kube), pass their readiness and liveness probes, serve
the metrics their scrape annotations point to, stream an epoch exactly once
to a trainer that reaches them through the Service name, and drain on
SIGTERM within the grace period. The components compose: every
combination an installation may list renders, validates and holds the same
rules (unprivileged pods on a read-only root, volumes sized to what the
flags let a daemon keep, a disruption budget, a network policy, no fixed
replicas under a scaler, a scaling query scoped to its installation). It
does not prove scheduling, volumes, the HPA's metrics adapter or DNS as a
cluster would do them."""
import json
import os
import secrets
import shutil
import subprocess
import sys
import textwrap

import click
import pytest

from dpex.auth import TOKEN_ENV
from dpex.testing import kube, netns, wait_until
from dpex.testing.nodes import write_node_data
from dpex.testing.pki import write_pki

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy", "kubernetes")
VARIANTS = ["base", "overlays/daemonset", "overlays/tls", "overlays/autoscale", "overlays/keda"]
# The components an installation may list together (the workers are a Deployment, which a scaler
# may own, or a DaemonSet, which none scales), each combination in a namespace of its own.
COMBINATIONS = [("daemonset", "tls"), ("tls", "daemonset"), ("tls", "autoscale"), ("keda", "tls")]
ALL = VARIANTS + ["components/" + "+".join(c) for c in COMBINATIONS]
# KEDA's ScaledObject, as far as the keda overlay uses it (the fields and types of KEDA's CRD,
# keda.sh/v1alpha1): no Kubernetes schema holds a custom resource, so this one checks it offline.
SCALED_OBJECT = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"}, "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "required": ["scaleTargetRef", "triggers"], "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                   "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                                  "name": {"type": "string"},
                                                  "envSourceContainerName": {"type": "string"}}},
                **{k: {"type": "integer", "minimum": 0} for k in (
                    "minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod",
                    "idleReplicaCount", "initialCooldownPeriod")},
                "triggers": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["type", "metadata"],
                    "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                   "metadata": {"type": "object", "additionalProperties": {"type": "string"}}}}},
            }},
    }}
SAMPLES = 120

needs_kubectl = pytest.mark.skipif(not shutil.which("kubectl"), reason="needs kubectl")


def rendered(variant: str) -> list[dict]:
    """A shipped overlay, or ``components/A+B``: an installation's kustomization listing those
    components (and, with keda, overlays/keda's replacement), in namespace team-a."""
    if not variant.startswith("components/"):
        return kube.render(os.path.join(DEPLOY, variant))
    import yaml
    components = variant.removeprefix("components/").split("+")
    config = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "team-a",
              "resources": ["../../base"], "components": [f"../../components/{c}" for c in components]}
    if "keda" in components:
        keda = yaml.safe_load(open(os.path.join(DEPLOY, "overlays", "keda", "kustomization.yaml")))
        config["replacements"] = keda["replacements"]
    return kube.render_installation(DEPLOY, yaml.safe_dump(config))


def quantity(text) -> float:
    """A Kubernetes quantity (``512Mi``, ``3Gi``, ``500m``, ``2``) as a number (bytes)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    text = str(text)
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit):
            return float(text[:-len(unit)]) * units[unit]
    return float(text)


def cli_params(container: dict, cli, monkeypatch) -> dict:
    """What the daemon's CLI makes of the container's args and environment."""
    for name in [n for n in os.environ if n.startswith("DPEX_")]:
        monkeypatch.delenv(name)
    for name, value in kube.container_env(container, "10.0.0.1", {"dpex-auth": {"token": "t"}}, {}).items():
        monkeypatch.setenv(name, value)
    args = list(container.get("args", []))
    return cli.make_context(cli.name, args).params


def workers_of(objects):
    return next(o for o in objects if o["kind"] in ("Deployment", "DaemonSet"))


@needs_kubectl
@pytest.mark.parametrize("variant", ALL)
def test_manifests_render_validate_and_match_the_clis(variant, monkeypatch):
    from dpex.cmd.dispatcher import main as dispatcher_cli
    from dpex.cmd.worker import main as worker_cli
    objects = rendered(variant)
    kube.validate([o for o in objects if o["kind"] != "ScaledObject"])  # strict: an unknown field fails too
    dispatcher = kube.find(objects, "StatefulSet", "dpex-dispatcher")
    assert dispatcher["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "journal"
    assert kube.find(objects, "Service", "dpex-dispatcher")["spec"]["ports"][0]["port"] == 7070
    for workload, cli in ((dispatcher, dispatcher_cli), (workers_of(objects), worker_cli)):
        spec = kube.pod_spec(workload)
        (container,) = spec["containers"]
        assert container["image"] == "dpex:latest"
        assert {"readinessProbe", "livenessProbe"} <= set(container) and container["resources"]["requests"]
        envvars = {p.envvar for p in cli.params if p.envvar} | {TOKEN_ENV}  # the token: read by dpex.auth
        names = {v["name"] for v in container["env"] if v["name"].startswith("DPEX_")}
        assert names <= envvars, f"variables no CLI option reads: {names - envvars}"
        env = kube.container_env(container, "10.0.0.1", {"dpex-auth": {"token": "t"}}, {})
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        cli.make_context(cli.name, list(container["args"]))  # every flag and variable exists and parses
        metrics = container["args"][container["args"].index("--metrics-port") + 1]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == metrics
        drain = float(next((v["value"] for v in container["env"] if v["name"] == "DPEX_DRAIN_TIMEOUT"), 2))
        assert spec["terminationGracePeriodSeconds"] > drain + 5  # the drain, then the batch processes' end
    if "autoscale" in variant:
        hpa = kube.find(objects, "HorizontalPodAutoscaler")
        assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "dpex_workers_needed"
    if "keda" in variant:  # KEDA scales the workers to the dispatcher's own policy's number
        import jsonschema
        scaled = kube.find(objects, "ScaledObject", "dpex-worker")
        jsonschema.validate(scaled, SCALED_OBJECT)
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "prometheus" and "dpex_workers_wanted" in trigger["metadata"]["query"]
        # this installation's dispatcher only: the query names the namespace it is rendered into
        assert f'{{namespace="{kube.namespace_of(objects)}"}}' in trigger["metadata"]["query"]
        env = {v["name"]: v.get("value") for v in kube.pod_spec(dispatcher)["containers"][0]["env"]}
        bounds = (int(env["DPEX_MIN_WORKERS"]), int(env["DPEX_MAX_WORKERS"]))
        assert bounds == (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"])
        assert scaled["spec"]["scaleTargetRef"]["name"] == workers_of(objects)["metadata"]["name"]
    for scaler in [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]:
        target = scaler["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == (workers_of(objects)["kind"], workers_of(objects)["metadata"]["name"])
        assert "replicas" not in workers_of(objects)["spec"], "a fixed replicas fights the scaler"
    if "daemonset" in variant:
        assert not [o for o in objects if o["kind"] == "Deployment"]
    if variant == "overlays/daemonset":
        base_pod = kube.pod_spec(workers_of(rendered("base")))
        ds_pod = dict(kube.pod_spec(workers_of(objects)))
        assert ds_pod.pop("nodeSelector") == {"dpex.io/data": "true"} and ds_pod == base_pod


TRAINER = textwrap.dedent("""
    import json, sys
    import dpex
    spec = dpex.DatasetSpec("dpex.testing.datasets:NodeFiles", {samples}, 0.002, root="$DPEX_DATA_PATH")
    with dpex.RemoteDataLoader("dpex-dispatcher:7070", spec, batch_size=4, timeout=120) as dl:
        got = list(dl)
    batches = [[int(i) for i in b["i"]] for b in got]
    nodes = sorted({{n for b in got for n in b["node"]}})
    print("RESULT " + json.dumps({{"batches": batches, "nodes": nodes}}))
""")


@needs_kubectl
@pytest.mark.parametrize("variant", ALL)
def test_pods_run_unprivileged_on_a_read_only_root_with_volumes_sized_to_the_flags(variant, monkeypatch):
    from dpex.cmd.dispatcher import main as dispatcher_cli
    from dpex.cmd.worker import main as worker_cli
    objects = rendered(variant)
    dockerfile = open(os.path.join(ROOT, "docker", "Dockerfile")).read()
    image_user = dockerfile.split("\nUSER ", 1)[1].split()[0].split(":")[0]
    for workload, cli in ((kube.find(objects, "StatefulSet", "dpex-dispatcher"), dispatcher_cli),
                          (workers_of(objects), worker_cli)):
        spec = kube.pod_spec(workload)
        (container,) = spec["containers"]
        pod_security, security = spec["securityContext"], container["securityContext"]
        assert pod_security["runAsNonRoot"] and str(pod_security["runAsUser"]) == image_user != "0"
        assert pod_security["seccompProfile"] == {"type": "RuntimeDefault"}
        assert security == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}}
        # Every place it writes is a volume: the temp directory is a disk emptyDir, whose
        # sizes the container's ephemeral-storage limit holds.
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: volumes.get(m["name"]) for m in container["volumeMounts"]}
        env = {v["name"]: v.get("value") for v in container["env"]}
        tmp = mounts[env["TMPDIR"]]
        assert tmp and "emptyDir" in tmp and tmp["emptyDir"].get("medium") != "Memory"
        disks = [quantity(v["emptyDir"]["sizeLimit"]) for v in volumes.values()
                 if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert quantity(limits["ephemeral-storage"]) >= sum(disks) and "ephemeral-storage" in requests
        params = cli_params(container, cli, monkeypatch)
        if cli is worker_cli:  # what the flags let it keep fits the volumes that hold it
            shm = mounts["/dev/shm"]["emptyDir"]
            kept = params["buffer_mb"] * 2**20 + params["share_cache_bytes"] + params["sample_cache_bytes"]
            assert shm["medium"] == "Memory" and quantity(shm["sizeLimit"]) >= kept + 512 * 2**20
            assert quantity(limits["memory"]) >= quantity(shm["sizeLimit"]) + 2**30  # /dev/shm is its memory
            assert quantity(tmp["emptyDir"]["sizeLimit"]) >= params["sample_disk_bytes"] + 512 * 2**20
            spread = spec["topologySpreadConstraints"][0]
            assert spread["topologyKey"] == "kubernetes.io/hostname"
            assert spread["labelSelector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"][
                "labels"].items()
        else:  # a long journal's replay is not a failed liveness probe
            startup = container["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


@needs_kubectl
@pytest.mark.parametrize("variant", ALL)
def test_a_disruption_budget_and_network_policies_cover_the_pods_and_their_ports(variant):
    objects = rendered(variant)
    workers = workers_of(objects)
    labels = workers["spec"]["template"]["metadata"]["labels"]
    budget = kube.find(objects, "PodDisruptionBudget", "dpex-worker")
    assert budget["spec"]["maxUnavailable"] == 1 and budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for workload in (kube.find(objects, "StatefulSet", "dpex-dispatcher"), workers):
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        (policy,) = [o for o in objects if o["kind"] == "NetworkPolicy"
                     and o["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        admitted = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
        (container,) = kube.pod_spec(workload)["containers"]
        assert admitted == {p["name"] for p in container["ports"]}  # its ports and no other


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_image_set_in_the_base_reaches_every_container_of_every_overlay(variant, tmp_path):
    # deploying's step (`kustomize edit set image dpex=REGISTRY/dpex:TAG` in base) left the
    # daemonset overlay's DaemonSet on dpex:latest (issue 61). The edit, as kustomize makes it:
    import yaml
    tree = tmp_path / "kubernetes"
    shutil.copytree(DEPLOY, tree)
    base = tree / "base" / "kustomization.yaml"
    config = yaml.safe_load(base.read_text())
    config["images"] = [{"name": "dpex", "newName": "registry.example/dpex", "newTag": "1.2.3"}]
    base.write_text(yaml.safe_dump(config))
    images = {c["image"] for obj in kube.render(str(tree / variant))
              for c in (obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or [])}
    assert images == {"registry.example/dpex:1.2.3"}


@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")
@needs_kubectl
@pytest.mark.parametrize("variant", ["base", "overlays/daemonset", "overlays/tls"])
def test_rendered_pods_probe_stream_an_epoch_and_drain(variant, tmp_path):
    objects = rendered(variant)
    namespace = kube.namespace_of(objects)
    dispatcher_set = kube.find(objects, "StatefulSet", "dpex-dispatcher")
    workers = workers_of(objects)
    token = secrets.token_hex(16)
    data = {name: str(tmp_path / name) for name in ("worker1", "worker2")}
    for name, path in data.items():
        write_node_data(path, name, SAMPLES)
    mounts = {"/var/lib/dpex": str(tmp_path / "journal")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPEX_")}
    env["DPEX_AUTH_TOKEN"] = token
    if variant == "overlays/tls":  # one certificate, as the overlay's comment asks: the Service and the pods
        tls = tmp_path / "tls"
        tls.mkdir()
        cert, key, ca = write_pki(tls, ["dpex-dispatcher", f"*.{namespace}.pod.cluster.local"], [])
        for name, path in (("tls.crt", cert), ("tls.key", key), ("ca.crt", ca)):
            os.link(path, tls / name)
        mounts["/etc/dpex/tls"] = str(tls)
        env["DPEX_TLS_CA"] = ca
    with kube.Pods({"dpex-auth": {"token": token}}, mounts, namespace) as pods:
        pods.add_service("dpex-dispatcher", pods.net.nodes["dispatcher"])
        # A worker that starts before the dispatcher says whom it cannot reach, and keeps trying.
        first = pods.start("worker1", workers, {"/data": data["worker1"]})
        wait_until(lambda: "cannot reach dispatcher dpex-dispatcher:7070" in first.log(), 60, "worker1's warning")
        dispatcher = pods.start("dispatcher", dispatcher_set)
        second = pods.start("worker2", workers, {"/data": data["worker2"]})
        for pod, workload in ((dispatcher, dispatcher_set), (first, workers), (second, workers)):
            for kind in [k for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in pod.container]:
                wait_until(lambda: pods.probe(pod, pod.container[kind], "trainer") or pod.process.poll() is not None,
                           120, f"{pod.name}'s {kind}")
                assert pod.process.poll() is None, pod.log()[-3000:]
            port = pod.container["args"][pod.container["args"].index("--metrics-port") + 1]
            annotations = workload["spec"]["template"]["metadata"]["annotations"]
            scheme = annotations.get("prometheus.io/scheme", "http")
            assert scheme == ("https" if "tls" in variant else "http")  # TLS serves its metrics over TLS too
            scrape = {"httpGet": {"port": int(port), "path": "/metrics", "scheme": scheme.upper()}}
            assert pods.probe(pod, scrape, "trainer"), f"no metrics where {pod.name}'s annotations point"
            plain = {"httpGet": {"port": int(port), "path": "/metrics", "scheme": "HTTP"}}
            assert pods.probe(pod, plain, "trainer") == (scheme == "http")
        trainer = subprocess.run(["ip", "netns", "exec", pods.net.ns("trainer"), sys.executable, "-c",
                                  TRAINER.format(samples=SAMPLES)], env=env, capture_output=True, text=True,
                                 timeout=300)
        assert trainer.returncode == 0, trainer.stderr[-3000:]
        result = json.loads(trainer.stdout.split("RESULT ", 1)[1])
        assert [i for b in result["batches"] for i in b] == list(range(SAMPLES))  # exactly once, in order
        assert result["nodes"] == ["worker1", "worker2"]  # each read from its own node's copy
        # SIGTERM drains within the grace period, and the worker leaves cleanly.
        took = pods.terminate(second)
        assert second.process.returncode == 0 and took < second.grace_s, second.log()[-2000:]
        assert '"msg": "shutting down"' in second.log()
        # A pod on a node without the data refuses to start, naming the path.
        bare = pods.start("worker3", workers, {"/data": str(tmp_path / "nothing-here")})
        assert bare.process.wait(60) != 0 and "nothing-here" in bare.log() and "copy the data" in bare.log()


def test_cli_option_envvars_are_what_the_manifests_may_use():
    """The manifests configure the daemons through DPEX_* variables: every
    option of both CLIs has one (so a manifest can set any of them)."""
    from dpex.cmd.dispatcher import main as dispatcher_cli
    from dpex.cmd.worker import main as worker_cli
    for cli in (dispatcher_cli, worker_cli):
        missing = [p.name for p in cli.params if isinstance(p, click.Option) and not p.envvar
                   and not p.hidden and p.name not in ("help", "version")]
        assert not missing, f"{cli.name}: options without a DPEX_ variable: {missing}"
