"""A Ray cluster on this machine whose autoscaler adds and removes nodes:
Ray's fake multi-node provider (what Ray's own autoscaler tests use, through
ray.cluster_utils.AutoscalingCluster), started on ports and a temporary
directory of its own and stopped by killing only its own processes, so that
another Ray cluster on the machine (a test beside it) is left alone."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from dpex.testing.cluster import free_port

HEAD_TYPE = "ray.head.default"


def _machine_ip() -> str:
    """The address Ray's nodes use here: the interface of the default route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is looked up
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class FakeAutoscalingCluster:
    """A head of ``head_cpus`` CPUs and up to ``max_nodes`` nodes of
    ``node_cpus`` CPUs each, added while tasks or actors wait for CPUs and
    removed after ``idle_minutes`` without any."""

    def __init__(self, node_cpus: float = 1, max_nodes: int = 4, head_cpus: float = 0,
                 idle_minutes: float = 0.1) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths live under it
        self.port = free_port()
        self.address = f"{_machine_ip()}:{self.port}"
        self.head_cpus = head_cpus
        self.config = {
            "cluster_name": "dpex-fake", "max_workers": max_nodes,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": self.address},
            "available_node_types": {
                HEAD_TYPE: {"resources": {"CPU": head_cpus}, "node_config": {}, "max_workers": 0},
                "cpu_node": {"resources": {"CPU": node_cpus}, "node_config": {}, "min_workers": 0,
                             "max_workers": max_nodes},
            },
            "head_node_type": HEAD_TYPE, "auth": {}, "upscaling_speed": 1.0, "idle_timeout_minutes": idle_minutes,
            "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
            "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }

    def start(self) -> "FakeAutoscalingCluster":
        config = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config, "w") as f:
            json.dump(self.config, f)
        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        # The fake nodes reach the head at the machine's address: not bound to loopback only.
        env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
        env.update(AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_FAKE_CLUSTER="1", RAY_TMPDIR=self.temp_dir)
        subprocess.run([ray, "start", "--head", f"--autoscaling-config={config}", f"--port={self.port}",
                        f"--num-cpus={self.head_cpus}", f"--temp-dir={self.temp_dir}",
                        f"--ray-client-server-port={free_port()}",
                        "--include-dashboard=false", "--disable-usage-stats"],
                       env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def pids(self) -> list[int]:
        """This cluster's processes: those that name its temporary directory."""
        mine = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.temp_dir.encode() in f.read():
                        mine.append(int(pid))
            except OSError:
                continue
        return mine

    def shutdown(self) -> None:
        for _ in range(3):  # a node's processes may start one another while it stops
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "FakeAutoscalingCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
