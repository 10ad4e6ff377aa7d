"""Real separate hosts on one machine: Linux network namespaces (root only).

A hub namespace holds a bridge; every node (the dispatcher, each worker, the
trainer) gets a namespace of its own with one veth link to the hub and its own
10.77.0.x address. A link can be cut and healed at the hub. Each worker reads
its own data directory (``$DPEX_NODE_DATA``), whose files name the node.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any

from dpex.auth import TOKEN_ENV
from dpex.launch import warmstart
from dpex.procutil import PARENT_ENV
from dpex.testing import programs
from dpex.testing.cluster import HEARTBEAT_TIMEOUT_S, wait_until
from dpex.testing.nodes import write_node_data

SUBNET = "10.77.0"
DISPATCHER_PORT = 7070


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and \
        subprocess.run(["ip", "netns", "list"], capture_output=True).returncode == 0


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True)


class NetnsCluster:
    def __init__(self, workers: int = 3, samples: int = 200, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
                 dispatcher: bool = True) -> None:
        """A hub and the hosts; with ``dispatcher`` (and ``workers``), the
        daemons on theirs; without, only the trainer's host."""
        self.tag = f"dx{os.getpid() % 100000}"
        self.token = secrets.token_hex(16)  # the hosts talk across a network: authenticated
        self.dir = tempfile.mkdtemp(prefix="dpex-netns-")
        self.samples = samples
        self.hb_timeout = heartbeat_timeout_s
        self.nodes: dict[str, str] = {}          # node -> its IP
        self.procs: dict[str, Any] = {}  # Popen-like (warmstart.WarmProcess)
        self._next_host = 10
        try:
            subprocess.run(["ip", "netns", "add", f"{self.tag}-hub"], check=True, capture_output=True)
            _ip("link", "add", "br0", "type", "bridge", ns=f"{self.tag}-hub")
            _ip("link", "set", "br0", "up", ns=f"{self.tag}-hub")
            self.add_node("dispatcher", host=1)
            self.add_node("trainer", host=100)
            if not dispatcher:
                return
            self.start_dispatcher()
            for _ in range(workers):
                self.add_worker()
        except BaseException:
            self.close()
            raise

    # ---- hosts and links --------------------------------------------------------
    def ns(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def add_node(self, node: str, host: int | None = None) -> str:
        if host is None:
            self._next_host += 1
            host = self._next_host
        ip = f"{SUBNET}.{host}"
        ns, hub, veth = self.ns(node), f"{self.tag}-hub", f"{self.tag}{host}"
        subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
        _ip("link", "add", f"{veth}h", "type", "veth", "peer", "name", f"{veth}n")
        _ip("link", "set", f"{veth}h", "netns", hub)
        _ip("link", "set", f"{veth}n", "netns", ns)
        _ip("link", "set", f"{veth}h", "master", "br0", ns=hub)
        _ip("link", "set", f"{veth}h", "up", ns=hub)
        _ip("addr", "add", f"{ip}/24", "dev", f"{veth}n", ns=ns)
        _ip("link", "set", f"{veth}n", "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        self.nodes[node] = ip
        return ip

    def _link(self, node: str) -> str:
        return f"{self.tag}{self.nodes[node].rsplit('.', 1)[1]}h"

    def cut(self, node: str) -> None:
        """Cuts the node's link at the hub: its packets go nowhere."""
        _ip("link", "set", self._link(node), "down", ns=f"{self.tag}-hub")

    def heal(self, node: str) -> None:
        """Puts a cut link back up."""
        _ip("link", "set", self._link(node), "up", ns=f"{self.tag}-hub")

    def shape(self, node: str, mbit: float) -> None:
        """Holds what the node sends to ``mbit`` Mbit/s (tc's token bucket on its end of the link)."""
        veth = f"{self._link(node)[:-1]}n"
        subprocess.run(["ip", "netns", "exec", self.ns(node), "tc", "qdisc", "add", "dev", veth, "root", "tbf",
                        "rate", f"{mbit}mbit", "burst", "64kb", "latency", "1s"], check=True, capture_output=True)

    # ---- daemons ------------------------------------------------------------------
    # Each a process in its node's namespace, forked from a warm starter (dpex.launch.warmstart) that
    # imported torch and the daemons once, as `ip netns exec NS python ARGS` would run it.
    def _spawn(self, node: str, args: list[str], env: dict[str, str] | None = None) -> Any:
        env = {**os.environ, TOKEN_ENV: self.token, PARENT_ENV: str(os.getpid()), **(env or {})}  # ends with us
        return warmstart.starter().start(list(args), env,
                                         os.path.join(self.dir, f"{node}.log"), netns=self.ns(node))

    def _await_ready(self, node: str, ready: str) -> None:
        proc = self.procs[node]
        wait_until(lambda: os.path.exists(ready) or proc.poll() is not None, 120, f"{node} to start")
        if proc.poll() is not None:
            raise RuntimeError(f"{node} exited at start:\n{self.log(node)}")

    def log(self, node: str) -> str:
        try:
            with open(os.path.join(self.dir, f"{node}.log"), errors="replace") as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    @property
    def address(self) -> str:
        return f"{self.nodes['dispatcher']}:{DISPATCHER_PORT}"

    def start_dispatcher(self) -> None:
        ready = os.path.join(self.dir, f"dispatcher-{time.monotonic_ns()}.ready")
        self.procs["dispatcher"] = self._spawn("dispatcher", [
            "-m", "dpex.cmd.dispatcher", "--host", self.nodes["dispatcher"], "--port", str(DISPATCHER_PORT),
            "--work-dir", os.path.join(self.dir, "journal"), "--heartbeat-interval", "0.2",
            "--heartbeat-timeout", str(self.hb_timeout), "--split-size", "2", "--ready-file", ready])
        self._await_ready("dispatcher", ready)

    def restart_dispatcher(self, sig: int = signal.SIGKILL) -> None:
        self.procs["dispatcher"].send_signal(sig)
        self.procs["dispatcher"].wait()
        self.start_dispatcher()

    def add_worker(self) -> str:
        node = f"worker{sum(n.startswith('worker') for n in self.nodes) + 1}"
        self.add_node(node)
        write_node_data(os.path.join(self.dir, "data", node), node, self.samples)  # the node's own copy
        self.start_worker(node)
        return node

    def start_worker(self, node: str) -> None:
        """Starts the worker of ``node`` (again, after :meth:`kill`: on its address)."""
        ip, data = self.nodes[node], os.path.join(self.dir, "data", node)
        ready = os.path.join(self.dir, f"{node}-{time.monotonic_ns()}.ready")
        self.procs[node] = self._spawn(node, [
            "-m", "dpex.cmd.worker", "--dispatcher", self.address, "--host", ip, "--port", "7071",
            "--processes", "1", "--heartbeat-interval", "0.2", "--no-shm", "--ready-file", ready],
            env={"DPEX_NODE_DATA": data})
        self._await_ready(node, ready)

    def kill(self, node: str) -> None:
        self.procs[node].send_signal(signal.SIGKILL)
        self.procs[node].wait()

    def run_trainer(self, epochs: int, delay_s: float) -> Any:
        """Starts dpex.testing.nodes' trainer in the trainer's namespace (no data there), as ``Popen``."""
        return programs.popen(["-m", "dpex.testing.nodes", "train", self.address, str(self.samples), str(epochs),
                               str(delay_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=self._trainer_env(), netns=self.ns("trainer"))

    def run(self, node: str, args: list[str], cwd: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
        """Runs ``python ARGS`` on ``node`` (with the cluster's token) to its end."""
        return programs.run(args, cwd=cwd, env=self._trainer_env(), timeout=timeout, netns=self.ns(node))

    def _trainer_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "DPEX_NODE_DATA"}
        env[TOKEN_ENV] = self.token
        return env

    # ---- teardown -------------------------------------------------------------------
    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for node in list(self.nodes) + ["hub"]:
            subprocess.run(["ip", "netns", "del", self.ns(node)], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
