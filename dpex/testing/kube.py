"""deploy/kubernetes without Kubernetes: render the manifests with ``kubectl
kustomize``, validate every object against the Kubernetes schema offline
(kubernetes-validate), and run each container's command, args and env as a
process in a network namespace of its own (its pod, with its own IP), with
the Services' names in the pod's hosts file. What Kubernetes itself provides
is stood in for, and only that: the pod IP and namespace (downward API),
Secrets, resource requests (``resourceFieldRef``), volume mounts (a local
directory per mount path; a fresh one for a disk ``emptyDir``) and Service
DNS (a hosts entry). Exec probes run in the pod's host with its environment.

``python -m dpex.testing.kube probe POD_IP PROBE_JSON`` runs one network
probe the way the kubelet does (gRPC health, TCP connect or HTTP GET) and
exits 0 if it passes.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from dpex.testing.netns import NetnsCluster

KUBERNETES_VERSION = "1.32.0"  # kubectl's on the image
NAMESPACE = "default"


def render(path: str) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize PATH`` renders."""
    import yaml
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_installation(deploy: str, kustomization: str) -> list[dict[str, Any]]:
    """The objects an installation's own ``kustomization`` (its text) renders, saved where the docs say:
    ``overlays/mine`` of a copy of the ``deploy`` tree (``deploy/kubernetes``), so that its
    ``../../base`` and ``../../components/...`` are the shipped ones."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        tree = shutil.copytree(deploy, os.path.join(tmp, "kubernetes"))
        os.makedirs(os.path.join(tree, "overlays", "mine"))
        with open(os.path.join(tree, "overlays", "mine", "kustomization.yaml"), "w") as f:
            f.write(kustomization)
        return render(os.path.join(tree, "overlays", "mine"))


def validate(objects: list[dict[str, Any]], version: str = KUBERNETES_VERSION) -> None:
    """Every object against the schema of ``version``, strictly (an unknown field fails)."""
    import kubernetes_validate
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    if len(found) != 1:
        raise LookupError(f"{len(found)} objects of kind {kind} named {name}")
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def cpu_quantity(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _local(text: str, mounts: dict[str, str]) -> str:
    """A path in the container as the local directory mounted there."""
    for mount, local in mounts.items():
        if text == mount or text.startswith(mount + "/"):
            return local + text[len(mount):]
    return text


def namespace_of(objects: list[dict[str, Any]]) -> str:
    """The namespace the rendered objects go to (``default`` when they name none)."""
    names = {o["metadata"].get("namespace", NAMESPACE) for o in objects}
    if len(names) != 1:
        raise ValueError(f"objects in several namespaces: {sorted(names)}")
    return names.pop()


def container_env(container: dict[str, Any], pod_ip: str, secrets: dict[str, dict[str, str]],
                  mounts: dict[str, str], namespace: str = NAMESPACE) -> dict[str, str]:
    """The container's environment as the kubelet would set it."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            value = var["value"]
        else:
            ref = var["valueFrom"]
            if "secretKeyRef" in ref:
                value = secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
            elif "fieldRef" in ref:
                value = {"status.podIP": pod_ip, "metadata.namespace": namespace}[ref["fieldRef"]["fieldPath"]]
            else:  # resourceFieldRef: the request in units of the divisor, rounded up
                res = ref["resourceFieldRef"]
                kind, what = res["resource"].split(".")
                amount = cpu_quantity(container["resources"][kind][what])
                value = str(math.ceil(amount / cpu_quantity(str(res.get("divisor", "1")))))
        env[var["name"]] = _local(value, mounts)
    return env


@dataclass
class Pod:
    name: str
    ip: str
    process: subprocess.Popen
    log_path: str
    container: dict[str, Any]
    grace_s: float
    env: dict[str, str]
    mounts: dict[str, str]  # mount path -> the local directory standing in for it

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


class Pods:
    """Pods on their own hosts (network namespaces); ``services`` names the
    pods that Service names resolve to."""

    def __init__(self, secrets: dict[str, dict[str, str]], mounts: dict[str, str],
                 namespace: str = NAMESPACE) -> None:
        self.net = NetnsCluster(workers=0, dispatcher=False)
        self.secrets, self.mounts, self.namespace = secrets, mounts, namespace
        self.pods: dict[str, Pod] = {}
        self.hosts: dict[str, str] = {}  # Service DNS name -> pod IP

    def add_service(self, name: str, pod_ip: str) -> None:
        ns = self.namespace
        for dns in (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"):
            self.add_dns(dns, pod_ip)

    def add_dns(self, name: str, ip: str) -> None:
        self.hosts[name] = ip
        for node in self.net.nodes:
            self._write_hosts(node)

    def _write_hosts(self, node: str) -> None:
        # `ip netns exec NS` mounts /etc/netns/NS/hosts over /etc/hosts
        folder = os.path.join("/etc/netns", self.net.ns(node))
        os.makedirs(folder, exist_ok=True)
        lines = ["127.0.0.1 localhost"] + [f"{ip} {dns}" for dns, ip in self.hosts.items()]
        with open(os.path.join(folder, "hosts"), "w") as f:
            f.write("\n".join(lines) + "\n")

    def host(self, name: str) -> str:
        """A host of its own (a trainer, say), with the Services in its hosts
        file; the cluster's own hosts (``dispatcher``, ``trainer``) are reused."""
        ip = self.net.nodes.get(name) or self.net.add_node(name)
        self._write_hosts(name)
        return ip

    def start(self, name: str, workload: dict[str, Any], mounts: dict[str, str] | None = None) -> Pod:
        """Runs the workload's (only) container as a pod named ``name``."""
        spec = pod_spec(workload)
        (container,) = spec["containers"]
        mounts = {**self.mounts, **(mounts or {})}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for m in container.get("volumeMounts", []):  # a disk emptyDir: a fresh directory of the pod's
            empty = volumes.get(m["name"], {}).get("emptyDir")
            if m["mountPath"] not in mounts and empty is not None and empty.get("medium") != "Memory":
                mounts[m["mountPath"]] = os.path.join(self.net.dir, f"{name}-{m['name']}")
                os.makedirs(mounts[m["mountPath"]], exist_ok=True)
        mounted = {m["mountPath"]: mounts[m["mountPath"]] for m in container.get("volumeMounts", [])
                   if m["mountPath"] in mounts}
        ip = self.host(name)
        self.add_dns(f"{ip.replace('.', '-')}.{self.namespace}.pod.cluster.local", ip)  # the pod's own DNS name
        bin_dir = os.path.dirname(sys.executable)  # the image's PATH: the package's commands
        # The image's command, found on this host (its path is the host's: not mapped as the pod's paths are,
        # which matters where the checkout lies under a mount path, /tmp say).
        executable = shutil.which(container["command"][0], path=f"{bin_dir}:/usr/bin:/bin")
        argv = [executable, *(_local(a, mounted) for a in container["command"][1:] + container.get("args", []))]
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
               "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               **container_env(container, ip, self.secrets, mounted, self.namespace)}
        log_path = os.path.join(self.net.dir, f"{name}.log")
        with open(log_path, "ab") as log:
            process = subprocess.Popen(["ip", "netns", "exec", self.net.ns(name), *argv], env=env,
                                       stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        pod = Pod(name, ip, process, log_path, container, float(spec.get("terminationGracePeriodSeconds", 30)),
                  env, mounted)
        self.pods[name] = pod
        return pod

    def probe(self, pod: Pod, probe: dict[str, Any], from_host: str) -> bool:
        """Runs ``probe`` against the pod from ``from_host``, as the kubelet would
        (an exec probe: in the pod, with its environment, within its timeout)."""
        if "exec" in probe:
            argv = [_local(a, pod.mounts) for a in probe["exec"]["command"]]
            try:
                result = subprocess.run(["ip", "netns", "exec", self.net.ns(pod.name), *argv], env=pod.env,
                                        capture_output=True, text=True, timeout=probe.get("timeoutSeconds", 1))
            except subprocess.TimeoutExpired:
                return False
            return result.returncode == 0
        result = subprocess.run(["ip", "netns", "exec", self.net.ns(from_host), sys.executable, "-m",
                                 "dpex.testing.kube", "probe", pod.ip, json.dumps(probe)],
                                capture_output=True, text=True, timeout=60)
        return result.returncode == 0

    def terminate(self, pod: Pod) -> float:
        """SIGTERM, as the kubelet stops a pod; the seconds it took to exit
        (SIGKILL at the grace period, as the kubelet would)."""
        import time
        start = time.monotonic()
        pod.process.send_signal(signal.SIGTERM)
        try:
            pod.process.wait(pod.grace_s)
        except subprocess.TimeoutExpired:
            pod.process.kill()
            pod.process.wait()
        return time.monotonic() - start

    def close(self) -> None:
        for pod in self.pods.values():
            if pod.process.poll() is None:
                pod.process.terminate()
        for pod in self.pods.values():
            try:
                pod.process.wait(30)
            except subprocess.TimeoutExpired:
                pod.process.kill()
                pod.process.wait()
        for node in self.net.nodes:
            shutil.rmtree(os.path.join("/etc/netns", self.net.ns(node)), ignore_errors=True)
        self.net.close()

    def __enter__(self) -> "Pods":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def probe(ip: str, spec: dict[str, Any], timeout_s: float = 5.0) -> bool:
    """One kubelet probe: gRPC health (SERVING), TCP connect, or HTTP GET (2xx/3xx)."""
    import socket
    if "grpc" in spec:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(f"{ip}:{spec['grpc']['port']}") as ch:
            try:
                answer = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=spec["grpc"].get("service", "")), timeout=timeout_s)
            except grpc.RpcError:
                return False
        return answer.status == health_pb2.HealthCheckResponse.SERVING
    if "tcpSocket" in spec:
        try:
            socket.create_connection((ip, int(spec["tcpSocket"]["port"])), timeout=timeout_s).close()
            return True
        except OSError:
            return False
    import ssl
    import urllib.request
    get = spec["httpGet"]
    scheme = get.get("scheme", "HTTP").lower()
    unverified = ssl._create_unverified_context() if scheme == "https" else None  # as the kubelet's HTTPS probe
    try:
        with urllib.request.urlopen(f"{scheme}://{ip}:{get['port']}{get.get('path', '/')}", timeout=timeout_s,
                                    context=unverified) as r:
            return 200 <= r.status < 400
    except OSError:
        return False


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "probe":
        sys.exit("usage: python -m dpex.testing.kube probe POD_IP PROBE_JSON")
    sys.exit(0 if probe(sys.argv[2], json.loads(sys.argv[3])) else 1)
