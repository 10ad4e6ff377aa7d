"""Issue 55: "the same definition" is the same content, not the same pickle.
A TensorDataset's pickle names its storage per process, and a class of the
script's travels by value with a tracker id of cloudpickle's per process:
a rerun of the same command under its job name (after kill -9 too) takes its
consumer over, and a sweep's trials in processes of their own share one label."""
import signal
import subprocess
import sys
import textwrap

import pytest

from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import call, channel
from dpex.testing import test_cluster

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from torch.utils.data import Dataset, TensorDataset
    import dpex

    class Scaled(Dataset):  # the script's own class: shipped by value
        def __init__(self):
            self.data = torch.arange(48.)

        def __len__(self):
            return 48

        def __getitem__(self, i):
            return self.data[i] * 2

    address, kind, name, stop = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dataset = TensorDataset(torch.arange(48.)) if kind == "tensor" else Scaled()
    with dpex.RemoteDataLoader(address, dataset, batch_size=4, shuffle=True, seed=1, job_name=name or None,
                               timeout=60) as loader:
        seen = 0
        for batch in loader:
            seen += 1
            if seen == stop:
                print("STOPPED", flush=True)
                sys.stdin.read()  # until killed
        print("DONE", seen, flush=True)
""")


@pytest.fixture(scope="module")
def cluster():
    with test_cluster(num_workers=1, processes=2) as c:
        yield c


def start(tmp_path, *args):
    script = tmp_path / "trial.py"
    script.write_text(SCRIPT)
    return subprocess.Popen([sys.executable, str(script), *map(str, args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("kind", ["tensor", "class"])
def test_a_rerun_under_its_job_name_takes_its_consumer_over_after_kill_9(cluster, tmp_path, kind):
    first = start(tmp_path, cluster.address, kind, f"rerun-{kind}", 2)
    assert first.stdout.readline().strip() == "STOPPED"
    first.send_signal(signal.SIGKILL)
    first.wait(30)
    again = start(tmp_path, cluster.address, kind, f"rerun-{kind}", -1)
    out, err = again.communicate(timeout=240)
    assert again.returncode == 0 and out.strip() == "DONE 12", err[-3000:]


@pytest.mark.parametrize("kind", ["tensor", "class"])
def test_a_sweeps_trials_in_processes_of_their_own_are_one_definition(cluster, tmp_path, kind):
    trials = [start(tmp_path, cluster.address, kind, "", -1) for _ in range(3)]
    for trial in trials:
        out, err = trial.communicate(timeout=240)
        assert trial.returncode == 0 and out.strip() == "DONE 12", err[-3000:]
    status = call(dgrpc.DispatcherStub(channel(cluster.address)).GetStatus, dpb.GetStatusRequest(),
                  target="dispatcher", timeout_s=10)
    labels = [j.shares for j in status.jobs if not j.name]
    assert len(labels) >= 3 and max(labels.count(x) for x in set(labels) - {""}) >= 3
