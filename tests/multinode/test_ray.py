"""Dpex on a real Ray cluster of three nodes built on this machine
(ray.cluster_utils.Cluster), each node with its own data directory: its
raylet, and so its actors and their dpex-worker, see $DPEX_NODE_DATA as that
node's directory, and every sample names the node whose copy it was read from.
The trainer has no $DPEX_NODE_DATA: a sample read on its side would fail.

Ray binds its nodes to 127.0.0.1 here (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
keeps it from resolving "localhost" to the machine's interface address), so
no traffic leaves loopback; and it writes its address file to a temporary
RAY_TMPDIR, not /tmp/ray, so a developer's own Ray node is left alone."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Short (Ray's socket paths live under it), and made by Ray only if a test here runs.
RAY_DIR = os.path.join(tempfile.gettempdir(), f"ray-dpex-{os.getpid()}")
os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_TMPDIR=RAY_DIR)

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import dpex.ray  # noqa: E402
from dpex import DatasetSpec, DpexDataLoader, DpexConfigError, DpexConnectionError  # noqa: E402
from dpex.testing import free_port, wait_until  # noqa: E402

SAMPLES = 240
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def daemons_started_by_ray() -> list[str]:
    """Command lines of running dpex daemons that a Ray actor started."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "dpex.cmd." in cmd and "dpex-ray-" in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def node_data(root: str, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path)
    for i in range(SAMPLES):
        with open(os.path.join(path, f"{i}.txt"), "w") as f:
            f.write(f"{name}:{i}")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    data = str(tmp_path_factory.mktemp("nodes"))
    base = dict(num_cpus=1, include_dashboard=False)
    client_port = free_port()
    c = Cluster(initialize_head=True,
                head_node_args=dict(base, ray_client_server_port=client_port,
                                    env_vars={"DPEX_NODE_DATA": node_data(data, "node0")}))
    c.client_address = f"ray://127.0.0.1:{client_port}"
    try:
        c.nodes_by_name = {"node0": c.head_node}
        for name in ("node1", "node2"):
            c.nodes_by_name[name] = c.add_node(**base, env_vars={"DPEX_NODE_DATA": node_data(data, name)})
        c.data = data
        yield c
    finally:
        try:
            dpex.ray.stop(c.address)
        finally:
            c.shutdown()
            shutil.rmtree(RAY_DIR, ignore_errors=True)
        wait_until(lambda: not daemons_started_by_ray(), 30, "the daemons started on Ray to exit")


def indices(batches):
    return [[int(i) for i in b["i"]] for b in batches]


def torch_batches(batch_size, seed):
    import torch
    return [b.tolist() for b in DataLoader(range(SAMPLES), batch_size=batch_size, shuffle=True,
                                           generator=torch.Generator().manual_seed(seed))]


def test_auto_finds_the_ray_cluster_and_reads_every_nodes_own_data(cluster):
    import torch
    assert "DPEX_NODE_DATA" not in os.environ  # the trainer cannot read samples
    spec = DatasetSpec("dpex.testing.datasets:NodeFiles", SAMPLES, 0.002)
    with DpexDataLoader(spec, distribute_mode=True, batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(5)) as dl:
        batches = list(dl)
    assert indices(batches) == torch_batches(4, 5)  # each sample once, in torch's order
    assert {n for b in batches for n in b["node"]} == {"node0", "node1", "node2"}
    endpoint = dpex.ray.status(cluster.address)
    assert endpoint is not None and len(endpoint.workers) == 3
    assert dl.dispatcher_address == endpoint.address


def test_train_digits_example_with_auto_equals_torch(cluster, tmp_path):
    """The seed's example, unchanged: head_address="auto" lands on the Ray
    cluster, every node's worker produces batches, and the run (batches and
    losses) is the one torch's DataLoader gives."""
    before = dpex.ray.status(cluster.address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DPEX_")}
    runs = {}
    for name, flags in (("torch", []), ("dpex", ["--distribute"])):
        out = tmp_path / f"{name}.json"
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_digits.py"), "--epochs", "2",
                               "--out", str(out), *flags], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
    assert "loading on the Ray cluster" in proc.stderr  # it says where it went
    assert runs["dpex"]["seen"] == runs["torch"]["seen"]
    assert runs["dpex"]["losses"] == runs["torch"]["losses"]
    after = dpex.ray.status(cluster.address)
    assert after == before  # another trainer found the same actors by name
    produced = worker_batches(after)
    assert len(produced) == 3 and all(n > 0 for n in produced.values()), produced


def test_every_form_of_head_address(cluster, monkeypatch):
    """A bare Ray head address and a Ray Client address reach the same Dpex;
    a dispatcher address (dpex:// or bare) is used as it is."""
    endpoint = dpex.ray.status(cluster.address)
    spec = DatasetSpec("dpex.testing.datasets:NodeFiles", 24)
    for head in (cluster.address, cluster.client_address):
        with DpexDataLoader(spec, distribute_mode=True, head_address=head, batch_size=4) as dl:
            assert dl.dispatcher_address == endpoint.address and len(list(dl)) == 6
    monkeypatch.setenv("DPEX_AUTH_TOKEN", endpoint.auth_token)
    for head in ("dpex://" + endpoint.address, endpoint.address):
        with DpexDataLoader(spec, distribute_mode=True, head_address=head, batch_size=4) as dl:
            assert dl.dispatcher_address == endpoint.address and len(list(dl)) == 6


def worker_batches(endpoint) -> dict[str, int]:
    from dpex.proto import dispatcher_pb2 as dpb, dispatcher_pb2_grpc as dgrpc
    from dpex.rpc import channel
    with channel(endpoint.address, endpoint.auth_token) as ch:
        status = dgrpc.DispatcherStub(ch).GetStatus(dpb.GetStatusRequest(), timeout=10)
    return {w.address: w.load.batches_produced for w in status.workers if w.state == "alive"}


def test_nodes_without_the_data_path_get_no_worker(cluster):
    """A node that lacks the data is named, and the others serve; with no
    node able to serve, start() fails and leaves nothing running."""
    dpex.ray.start(cluster.address)  # found running (or started, when this test runs alone)
    assert dpex_cli("ray", "stop", "--address", cluster.address).stdout.strip() == "stopped"
    assert dpex_cli("ray", "status", "--address", cluster.address).returncode == 1
    for name in ("node0", "node2"):
        open(os.path.join(cluster.data, name, "READY"), "w").close()
    try:
        journal = os.path.join(cluster.data, "journal")
        config = dpex.ray.RayConfig(data_paths=("$DPEX_NODE_DATA/READY",), work_dir=journal)
        endpoint = dpex.ray.start(cluster.address, config, wait_s=60)
        assert len(endpoint.workers) == 2 and os.listdir(journal)  # the dispatcher journals there
        with DpexDataLoader(DatasetSpec("dpex.testing.datasets:NodeFiles", 40), distribute_mode=True,
                            batch_size=4) as dl:
            assert {n for b in dl for n in b["node"]} <= {"node0", "node2"}
        dpex.ray.stop(cluster.address)
        config = dpex.ray.RayConfig(data_paths=("/nonexistent/dpex-data",))
        with pytest.raises(dpex.DpexError, match=r"no node could run a worker: .*has no /nonexistent/dpex-data"):
            dpex.ray.start(cluster.address, config, wait_s=60)
        assert dpex.ray.status(cluster.address) is None
        wait_until(lambda: not daemons_started_by_ray(), 30, "the half-started daemons to exit")
    finally:
        for name in ("node0", "node2"):
            os.remove(os.path.join(cluster.data, name, "READY"))
    started = dpex_cli("ray", "start", "--address", cluster.address)  # as the other tests expect it
    assert started.returncode == 0 and "3 workers" in started.stdout, started.stderr[-2000:]
    assert dpex_cli("ray", "status", "--address", cluster.address).stdout == started.stdout


def dpex_cli(*args):
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "dpex"), *args], capture_output=True,
                          text=True, timeout=300)


def test_bad_ray_addresses_fail_clearly(monkeypatch):
    with pytest.raises(DpexConnectionError, match="nothing answers at the Ray address ray://127.0.0.1:1"):
        DpexDataLoader(list(range(8)), distribute_mode=True, head_address="ray://127.0.0.1:1")
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # "auto" takes it, and says it does not answer
    with pytest.raises(DpexConnectionError, match="nothing answers at the Ray address 127.0.0.1:1"):
        DpexDataLoader(list(range(8)), distribute_mode=True)
    monkeypatch.delenv("RAY_ADDRESS")
    # Without Ray installed, in a process of its own: import dpex works, a Ray address is refused.
    code = ("import sys; sys.modules['ray'] = None\n"
            "import dpex\n"
            "try:\n"
            "    dpex.DpexDataLoader(list(range(8)), distribute_mode=True, head_address='ray://127.0.0.1:10001')\n"
            "except dpex.DpexConfigError as e:\n"
            "    print('REFUSED', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in proc.stdout and "pip install 'dpex[ray]'" in proc.stdout, proc.stderr[-2000:]
    assert DpexConfigError  # the class the refusal is


def test_a_node_removed_mid_epoch_and_one_that_joins(cluster):
    import torch
    spec = DatasetSpec("dpex.testing.datasets:NodeFiles", SAMPLES, 0.01)
    batches = []
    with DpexDataLoader(spec, distribute_mode=True, batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(8)) as dl:
        for batch in dl:
            batches.append(batch)
            if len(batches) == 10:
                cluster.remove_node(cluster.nodes_by_name.pop("node2"))
    assert indices(batches) == torch_batches(4, 8)  # the epoch completed, each sample once
    wait_until(lambda: len(dpex.ray.status(cluster.address).workers) == 2, 60, "the left node's worker to go")
    cluster.nodes_by_name["node3"] = cluster.add_node(
        num_cpus=1, env_vars={"DPEX_NODE_DATA": node_data(cluster.data, "node3")})
    wait_until(lambda: len(dpex.ray.status(cluster.address).workers) == 3, 60, "a worker on the new node")
    with DpexDataLoader(spec, distribute_mode=True, batch_size=4) as dl:
        assert sorted(i for b in indices(dl) for i in b) == list(range(SAMPLES))
