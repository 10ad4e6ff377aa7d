"""The original project's training scenarios, run as a user runs them
(examples/train_digits.py), with the data path as the only difference."""
import gc
import json
import os
import random
import signal
import subprocess
import threading

import pytest

from dpex import DpexDataLoader
from dpex.launch import embedded
from dpex.testing import descendants, pids_alive, programs, wait_until
from tests.integration.commands import command
from dpex.testing.datasets import Squares

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "train_digits.py")


def train(cluster, tmp_path, mode, distribute, *extra, check=True):
    out = tmp_path / f"{mode}-{distribute}.json"
    args = ["--mode", mode, "--epochs", "1", "--out", str(out), *extra] + (["--distribute"] if distribute else [])
    # --log-dir: else torchrun leaves a torchelastic_* directory in /tmp
    cmd = ([command("torchrun"), "--standalone", "--nproc_per_node=2", "--log-dir",
            str(tmp_path / "elastic"), SCRIPT] if mode == "ddp"
           else [SCRIPT]) + args
    env = {**os.environ, "DPEX_DISPATCHER": cluster.address, "OMP_NUM_THREADS": "1"}
    if mode == "ddp":
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    else:  # forked warm (dpex.testing.programs), as `python SCRIPT` runs it
        done = programs.run(cmd, env=env, timeout=300)
    if not check:
        return done
    assert done.returncode == 0, done.stderr[-3000:]
    paths = [f"{out}.rank{r}" for r in range(2)] if mode == "ddp" else [str(out)]
    return [json.load(open(p)) for p in paths]


@pytest.mark.parametrize("mode", ["single", "dp"])
def test_same_losses_with_and_without_distribute_mode(cluster, tmp_path, mode):
    (ours,), (theirs,) = train(cluster, tmp_path, mode, True), train(cluster, tmp_path, mode, False)
    assert ours["seen"] == theirs["seen"]
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) < 1e-6
    assert ours["accuracy"] == pytest.approx(theirs["accuracy"])


def test_ddp_with_torchrun_gives_each_rank_its_shard(cluster, tmp_path):
    ranks = train(cluster, tmp_path, "ddp", True)
    torch_ranks = train(cluster, tmp_path, "ddp", False)
    shards = [[i for batch in r["seen"][0] for i in batch] for r in ranks]
    assert len(ranks[0]["seen"][0]) == len(ranks[1]["seen"][0]) == 24  # same batch count: no hang
    assert set(shards[0]).isdisjoint(shards[1]) and set(shards[0]) | set(shards[1]) == set(range(1500))
    for ours, theirs in zip(ranks, torch_ranks):
        assert ours["seen"] == theirs["seen"] and ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)


def test_a_preempted_run_resumes_from_its_checkpoint_to_the_same_parameters(cluster, tmp_path):
    """--checkpoint every 7 steps, SIGKILLed after a random step, run again:
    the final model is bitwise the uninterrupted run's."""
    (whole,) = train(cluster, tmp_path, "single", True, "--epochs", "2")
    ckpt, kill_after = str(tmp_path / "ckpt.pt"), random.randrange(8, 90)
    every = ["--epochs", "2", "--checkpoint", ckpt, "--checkpoint-every", "7"]
    killed = train(cluster, tmp_path, "single", True, *every, "--kill-after", str(kill_after), check=False)
    assert killed.returncode == -signal.SIGKILL and f"killed after step {kill_after}" in killed.stdout
    (resumed,) = train(cluster, tmp_path, "single", True, *every)
    assert resumed["params"] == whole["params"], f"killed after {kill_after}"
    assert resumed["losses"] == whole["losses"] and resumed["seen"] == whole["seen"]


def test_bug_dataset_fails_with_a_clear_error(cluster, tmp_path):
    done = train(cluster, tmp_path, "single", True, "--bug", check=False)
    assert done.returncode != 0
    # raised as its own type (as torch re-raises a worker's exception), with Dpex's facts first
    assert "\nZeroDivisionError: ZeroDivisionError: division by zero (raised in dataset[" in done.stderr
    assert "return 1 / 0" in done.stderr  # the remote traceback


def test_deleting_a_loader_mid_epoch_leaves_nothing_behind(monkeypatch):
    monkeypatch.delenv("DPEX_DISPATCHER", raising=False)  # "auto": an embedded cluster
    monkeypatch.setattr(embedded, "EMBEDDED_LINGER_S", 0.5)  # then it waits that long for another loader
    before, threads_before = set(descendants(os.getpid())), set(threading.enumerate())
    loader = DpexDataLoader(Squares(64), distribute_mode=True, batch_size=4, num_workers=1)
    it = iter(loader)
    assert next(it)["y"].tolist() == [0, 1, 2, 3]
    started = [p for p in descendants(os.getpid()) if p not in before]
    assert started
    del loader, it
    gc.collect()
    wait_until(lambda: pids_alive(started) == [], 30, "the embedded cluster to stop")
    ours = lambda: [t.name for t in set(threading.enumerate()) - threads_before  # noqa: E731
                    if t.name.startswith("dpex")]  # its own: not another test's in this process
    try:
        wait_until(lambda: not ours(), 10, "dpex threads to end")
    except TimeoutError:
        raise AssertionError(f"dpex threads still running: {ours()}") from None
