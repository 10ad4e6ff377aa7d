"""state_dict / load_state_dict: a resumed loader yields the rest of the epoch
and the next epochs exactly as an uninterrupted one would — after a clean
stop, and after the checkpointing trainer was SIGKILLed past its checkpoint
(with a worker killed, or the dispatcher restarted from its journal, meanwhile)."""
import os
import random
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.utils.data as tud

import dpex
from dpex.testing import test_cluster

N, B, EPOCHS = 103, 4, 3
SPEC = dpex.DatasetSpec("dpex.client.options:Indices", N)


class EveryThird(tud.Sampler):
    """A sampler Dpex cannot describe: its batches travel as indices."""

    def __len__(self):
        return N

    def __iter__(self):
        return iter([i for r in range(3) for i in range(r, N, 3)])


CASES = {
    "seed": dict(shuffle=True, seed=7),
    "generator": dict(shuffle=True, generator=torch.Generator().manual_seed(3)),
    "global RNG": dict(shuffle=True),
    "unordered": dict(shuffle=True, seed=7, ordered=False),
    "custom sampler": dict(sampler=EveryThird()),
    "explicit plans": dict(shuffle=True, seed=7, compact_plans=False),
}


def run(address, kwargs, stop_at=None, state=None):
    """Epochs of a loader (from ``state``); stops after ``stop_at`` batches: the batches and a state dict."""
    if "generator" in kwargs:  # every loader starts from the same generator, as a new process would
        kwargs = dict(kwargs, generator=torch.Generator().manual_seed(3))
    got, sd = [], None
    with dpex.RemoteDataLoader(address, SPEC, batch_size=B, timeout=60, **kwargs) as dl:
        if state is not None:
            dl.load_state_dict(state)
        start = state["epochs_started"] - (state["epoch"] is not None) if state else 0
        for epoch in range(start, EPOCHS):
            for batch in dl:
                got.append(batch.tolist())
                if len(got) == stop_at:
                    return got, dl.state_dict()
    return got, sd


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_loader_continues_exactly(case):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kwargs = CASES[case]
    with test_cluster(num_workers=2) as c:
        torch.manual_seed(11)
        whole, _ = run(c.address, kwargs)
        assert len(whole) == EPOCHS * 26
        for stop_at in sorted({rng.randrange(1, len(whole)), 26, 27, 52}):
            torch.manual_seed(11)
            first, sd = run(c.address, kwargs, stop_at)
            rng_state = torch.get_rng_state()  # a training script saves it with its checkpoint
            torch.manual_seed(99)  # the new process's RNG is anything
            torch.set_rng_state(rng_state)
            rest, _ = run(c.address, kwargs, state=sd)
            if kwargs.get("ordered") is False:  # the same batches of each epoch, in any order
                key = lambda bs: [sorted(map(tuple, bs[i:i + 26])) for i in range(0, len(bs), 26)]  # noqa: E731
                assert key(first + rest) == key(whole), f"stop at {stop_at}, seed {seed}"
            else:
                assert first + rest == whole, f"stop at {stop_at}, seed {seed}"


def test_a_state_dict_is_small_and_refused_when_it_does_not_fit():
    with test_cluster(num_workers=1) as c:
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, shuffle=True, timeout=60) as dl:
            it = iter(dl)
            next(it)
            sd = dl.state_dict()
        assert sd["epoch"]["done"] == [[0, 1]] and sd["epoch"]["batches"] is None
        assert len(sd["epoch"]["sampler"]) < 100  # the description, not the indices
        with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, num_consumers=2, consumer_index=1,
                                   job_name="other", timeout=60) as other:
            with pytest.raises(dpex.DpexConfigError, match="consumer 0 of 1.*consumer 1 of 2"):
                other.load_state_dict(sd)
            with pytest.raises(dpex.DpexConfigError, match="not a RemoteDataLoader state dict"):
                other.load_state_dict({"epoch": 3})


TRAINER = textwrap.dedent("""
    import os, signal, sys, torch, dpex
    address, path, out, stop_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    dl = dpex.RemoteDataLoader(address, dpex.DatasetSpec("dpex.testing.datasets:Slow", n=200, delay_s=0.002),
                               batch_size=4, shuffle=True, seed=5, job_name="resumable", timeout=60)
    state = torch.load(path) if os.path.exists(path) else None
    if state is not None:
        dl.load_state_dict(state)
    start = state["epochs_started"] - (state["epoch"] is not None) if state else 0
    with open(out, "a") as f:
        for epoch in range(start, 2):
            for batch in dl:
                f.write(" ".join(map(str, batch["y"].tolist())) + "\\n")
                f.flush()
                if state is None and sum(1 for _ in open(out)) == stop_at:
                    torch.save(dl.state_dict(), path)
                    f.write("checkpoint\\n")
                    f.flush()
                if state is None and sum(1 for _ in open(out)) == stop_at + 6:
                    print("kill me", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)  # past the checkpoint, batches in flight
    print("done", flush=True)
""")


def expected_epochs():
    g = torch.Generator().manual_seed(5)
    dl = tud.DataLoader(list(range(200)), batch_size=4, shuffle=True, generator=g)
    return [[b.tolist() for b in dl] for _ in range(2)]


@pytest.mark.parametrize("meanwhile", ["nothing", "a worker is killed", "the dispatcher restarts"])
def test_a_killed_trainer_resumes_from_its_checkpoint_exactly_once(tmp_path, meanwhile):
    path, out = str(tmp_path / "ckpt.pt"), str(tmp_path / "batches.txt")
    stop_at = random.randrange(5, 80)
    with test_cluster(num_workers=2, work_dir=str(tmp_path / "work")) as c:
        first = subprocess.run([sys.executable, "-c", TRAINER, c.address, path, out, str(stop_at)],
                               capture_output=True, text=True, timeout=120)
        assert first.returncode == -signal.SIGKILL and "kill me" in first.stdout, first.stderr
        if meanwhile == "a worker is killed":
            c.kill_worker(0)
        elif meanwhile == "the dispatcher restarts":
            c.restart_dispatcher()
        second = subprocess.run([sys.executable, "-c", TRAINER, c.address, path, out, str(stop_at)],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 0 and "done" in second.stdout, second.stderr
    lines = open(out).read().splitlines()
    cut = lines.index("checkpoint")
    # what the killed run saw after its checkpoint is thrown away; the resumed run goes on from it
    assert all(line != "checkpoint" for line in lines[cut + 1:])
    after = lines[cut + 1:cut + 6]  # the 5 batches the killed run got past its checkpoint
    seen = [list(map(int, line.split())) for line in lines[:cut] + lines[cut + 6:]]
    assert len(after) == 5 and [list(map(int, line.split())) for line in after] == seen[cut:cut + 5]
    whole = [b for epoch in expected_epochs() for b in epoch]
    assert seen == whole, f"stop at {stop_at}"
