"""state_dict / load_state_dict: a resumed loader yields the rest of the epoch
and the next epochs exactly as an uninterrupted one would — after a clean
stop, and after the checkpointing trainer was SIGKILLed past its checkpoint
(with a worker killed, or the dispatcher restarted from its journal, meanwhile)."""
import contextlib
import gc
import io
import random
import signal
import textwrap

import numpy as np
import pytest
import torch
import torch.utils.data._utils.worker as torch_worker
import torch.utils.data as tud

import dpex
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import channel
from dpex.testing import datasets, programs, test_cluster, wait_until
from dpex.testing.compare import read_epochs

N, B, EPOCHS = 103, 4, 3
SPEC = dpex.DatasetSpec("dpex.client.sampling:Indices", N)
PROBE = dpex.DatasetSpec("dpex.testing.datasets:WorkerProbe", N)
UNEVEN = dpex.DatasetSpec("dpex.testing.datasets:Uneven", 9)  # streams of 9, 18, 27 samples
STATEFUL = dpex.DatasetSpec("dpex.testing.datasets:StatefulUneven", 9)  # the same, with a state_dict


class EveryThird(tud.Sampler):
    """A sampler Dpex cannot describe: its batches travel as indices."""

    def __len__(self):
        return N

    def __iter__(self):
        return iter([i for r in range(3) for i in range(r, N, 3)])


class Rotating(tud.Sampler):
    """A sampler with its own state (torchdata's protocol): each epoch's order
    is rotated by how many epochs it made before."""

    def __init__(self):
        self.epochs = 0

    def __len__(self):
        return N

    def __iter__(self):
        shift, self.epochs = self.epochs * 7 % N, self.epochs + 1
        return iter([(i + shift) % N for i in range(N)])

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


CASES = {
    "seed": dict(shuffle=True, seed=7),
    "generator": dict(shuffle=True, generator=torch.Generator().manual_seed(3)),
    "global RNG": dict(shuffle=True),
    "unordered": dict(shuffle=True, seed=7, ordered=False),
    "custom sampler": dict(sampler=EveryThird()),
    "ShuffleSampler": dict(sampler=dpex.ShuffleSampler(N)),  # a seed from the global RNG per epoch
    "sampler with a state_dict": dict(sampler=Rotating()),
    "explicit plans": dict(shuffle=True, seed=7, compact_plans=False),
    "worker seeds": dict(dataset=PROBE, shuffle=True, seed=7, worker_init_fn=datasets.record_worker_init),
    "IterableDataset": dict(dataset=UNEVEN, num_workers=3),
    "IterableDataset unordered": dict(dataset=UNEVEN, num_workers=3, ordered=False),
    "IterableDataset with state_dict": dict(dataset=STATEFUL, num_workers=3),
    "IterableDataset with state_dict, unordered": dict(dataset=STATEFUL, num_workers=3, ordered=False),
}


def plain(batch):
    """A batch as comparable values. WorkerProbe's samples become (index, the
    epoch's base seed, whether the process was seeded and initialised as torch's
    worker ``id`` would be): which process made a batch is the workers' business."""
    if isinstance(batch, torch.Tensor):
        return batch.tolist()
    if "np_state" not in batch:
        return {k: plain(v) for k, v in batch.items()}
    out = []
    for i, wid, seed, torch_seed, np_state, calls in zip(*(batch[k].tolist() for k in (
            "i", "id", "seed", "torch_seed", "np_state", "init_calls"))):
        base = seed - wid
        np.random.seed(torch_worker._generate_state(base, wid))
        ok = torch_seed == seed and np_state == np.random.get_state()[1][:4].tolist() and calls >= 1
        out.append((i, base, ok))
    return out


def run(address, kwargs, stop_at=None, state=None):
    """Epochs of a loader (from ``state``); stops after ``stop_at`` batches:
    the (epoch, batch)s and a state dict."""
    kwargs = dict(kwargs)
    if "generator" in kwargs:  # every loader starts from the same generator, as a new process would
        kwargs["generator"] = torch.Generator().manual_seed(3)
    if isinstance(kwargs.get("sampler"), Rotating):  # and from a new sampler: its state comes from the state dict
        kwargs["sampler"] = Rotating()
    dataset = kwargs.pop("dataset", SPEC)
    with dpex.RemoteDataLoader(address, dataset, batch_size=B, timeout=60, **kwargs) as dl:
        return read_epochs(dl, EPOCHS, value=lambda epoch, batch: (epoch, plain(batch)), stop_at=stop_at,
                           state=state)


@pytest.fixture(scope="module")
def c():
    """One cluster for the resumes that kill nothing: each loader is a job of its
    own, as a long-lived cluster serves them (two processes per worker: batches
    of one epoch come from several processes)."""
    with test_cluster(num_workers=2, processes=2) as cluster:
        yield cluster


@pytest.mark.parametrize("case", CASES)
def test_a_resumed_loader_continues_exactly(c, case):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    kwargs = CASES[case]
    torch.manual_seed(11)
    whole, _ = run(c.address, kwargs)
    per_epoch = len(whole) // EPOCHS
    assert per_epoch == (26 if "dataset" not in kwargs or kwargs["dataset"] is PROBE else 3 + 5 + 7)
    assert all(max(b["start"]) == 0 for _, b in whole if isinstance(b, dict) and "start" in b)
    if kwargs.get("dataset") is PROBE:
        assert all(ok for _, batch in whole for _, _, ok in batch)
    stops = {rng.randrange(1, len(whole)), per_epoch, per_epoch + 1, 2 * per_epoch, 3, 4}
    if kwargs.get("num_workers"):  # streams are processes started per epoch: fewer, slower runs
        stops = {rng.randrange(1, per_epoch), per_epoch + rng.randrange(1, per_epoch)}
    for stop_at in sorted(stops):
        torch.manual_seed(11)
        first, sd = run(c.address, kwargs, stop_at)
        rng_state = torch.get_rng_state()  # a training script saves it with its checkpoint
        torch.manual_seed(99)  # the new process's RNG is anything
        torch.set_rng_state(rng_state)
        rest, _ = run(c.address, kwargs, state=torch_roundtrip(sd))
        if kwargs.get("dataset") is STATEFUL:  # streams went on from their states, not from their starts
            resumed_epoch = [b for e, b in rest if e == first[-1][0]]
            assert (stop_at % per_epoch == 0 or kwargs.get("ordered") is False
                    or any(max(b["start"]) > 0 for b in resumed_epoch))
            rest = [(e, dict(b, start=[0] * len(b["start"]))) for e, b in rest]
        if kwargs.get("ordered") is False:  # the same batches of each epoch, in any order
            key = lambda bs: sorted((e, repr(b)) for e, b in bs)  # noqa: E731
            assert key(first + rest) == key(whole), f"stop at {stop_at}, seed {seed}"
        else:
            assert first + rest == whole, f"stop at {stop_at}, seed {seed}"


def torch_roundtrip(sd):
    """The state dict as a checkpoint file gives it back."""
    buffer = io.BytesIO()
    torch.save(sd, buffer)
    buffer.seek(0)
    return torch.load(buffer)


@pytest.mark.parametrize("dataset", [SPEC, UNEVEN], ids=["map-style", "iterable"])
@pytest.mark.parametrize("where", ["mid-epoch", "at an epoch's end", "held in a cycle"])
def test_the_same_loader_resumes_after_its_iterator_was_dropped(c, dataset, where):
    """A training loop that failed restarts in the same process: its iterator dropped (ended by the
    reaper thread, later, or, held in a reference cycle, when the collector finds it), the same loader
    given the last state dict. The resumed epoch has the same number as the dropped one; the dropped one's
    end must not release it (it did, at random: "no plan for consumer 0 epoch 0", issue 55's tester; and
    held in a cycle, an epoch that stopped: "no batch arrived for 60s")."""
    kw = dict(batch_size=B, timeout=60, generator=torch.Generator().manual_seed(3),
              **({"num_workers": 2} if dataset is UNEVEN else {}))
    with dpex.RemoteDataLoader(c.address, dataset, **kw) as whole:
        want = [[plain(b) for b in whole] for _ in range(2)]
    with dpex.RemoteDataLoader(c.address, dataset, **dict(kw, generator=torch.Generator().manual_seed(3))) as dl:
        start = dl.state_dict()
        for _ in range(3):  # the race went either way
            dl.load_state_dict(start)
            it = iter(dl)
            first = plain(next(it))
            sd = dl.state_dict()
            if where == "at an epoch's end":
                first = [first] + [plain(b) for b in it]
                sd = dl.state_dict()
                it = iter(dl)  # the next epoch, begun and dropped
            next(it)  # a batch past the checkpoint: it comes again
            cycle = [it]
            if where == "held in a cycle":
                cycle.append(cycle)  # only the collector frees it
            del it, cycle
            dl.load_state_dict(torch_roundtrip(sd))
            resumed = iter(dl)
            got = [plain(next(resumed))]
            gc.collect()  # the iterator in a cycle goes now, mid-epoch of the resumed one
            got += [plain(b) for b in resumed]
            if where == "at an epoch's end":
                assert first == want[0] and got == want[1]
            else:
                assert [first] + got == want[0]


@pytest.mark.parametrize("where", ["mid-epoch", "at an epoch's end"])
def test_a_left_iterators_late_release_does_not_end_the_epoch_begun_again(c, monkeypatch, where):
    """The resume race (issue 58): the left iterator's ReleaseConsumer timed out on the trainer (5 s) yet
    reached a busy dispatcher after the same epoch's new plan, and released it ("stall after 8 batches").
    Here the release is held back and sent once the resumed epoch runs: each iter() submits its own
    attempt, and a release names the attempt it leaves."""
    from dpex.client import job as jobs
    held, send = [], jobs.releaser

    def late(stub, target, request):
        release = send(stub, target, request)
        return (lambda wait=True: held.append(release)) if request.HasField("epoch") else release
    monkeypatch.setattr(jobs, "releaser", late)
    kw = dict(batch_size=B, timeout=30, generator=torch.Generator().manual_seed(3))
    with dpex.RemoteDataLoader(c.address, SPEC, **kw) as whole:
        want = [[plain(b) for b in whole] for _ in range(2)]
    with dpex.RemoteDataLoader(c.address, SPEC, **dict(kw, generator=torch.Generator().manual_seed(3))) as dl:
        it = iter(dl)
        first = [plain(next(it))]
        if where == "at an epoch's end":
            first += [plain(b) for b in it]
            sd = dl.state_dict()
            it = iter(dl)  # the next epoch, begun
        else:
            sd = dl.state_dict()
        next(it)  # a batch past the checkpoint
        del it  # dropped: ended by the reaper thread, or by the next iter() if that comes first
        dl.load_state_dict(torch_roundtrip(sd))
        resumed = iter(dl)  # the old epoch is ended now, at the latest; its release is held back
        got = [plain(next(resumed))]
        assert len(held) == 1
        held.pop()()  # ... and reaches the dispatcher now, after the new plan
        got += [plain(b) for b in resumed]
        assert (first, got) == (want[0], want[1]) if where == "at an epoch's end" else first + got == want[0]


def test_a_state_dict_is_small_and_refused_when_it_does_not_fit(c):
    with dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, shuffle=True, timeout=60,
                               job_name="saved") as dl:
        it = iter(dl)
        next(it)
        sd = dl.state_dict()
    assert sd["epoch"]["done"] == [[0, 1]] and sd["epoch"]["batches"] is None
    assert len(sd["epoch"]["sampler"]) < 100  # the description, not the indices
    refusals = {
        "consumer 0 of 1.*consumer 1 of 2.*list of all 1 ranks": dict(num_consumers=2, consumer_index=1,
                                                                       job_name="other"),
        "dataset length 103.*dataset length 50": dict(dataset=dpex.DatasetSpec("dpex.client.sampling:Indices",
                                                                               50)),
        "batch size 4.*batch size 5": dict(batch_size=5),
        "job 'saved'.*job is 'another'": dict(job_name="another"),
    }
    for message, kwargs in refusals.items():
        kwargs = {"dataset": SPEC, "batch_size": B, **kwargs}
        with dpex.RemoteDataLoader(c.address, kwargs.pop("dataset"), timeout=60, **kwargs) as other:
            with pytest.raises(dpex.DpexConfigError, match=message):
                other.load_state_dict(sd)
            with pytest.raises(dpex.DpexConfigError, match="not a RemoteDataLoader state dict"):
                other.load_state_dict({"epoch": 3})
            with pytest.raises(dpex.DpexConfigError, match="version 1; this Dpex reads version 2"):
                other.load_state_dict(dict(sd, version=1))
            assert [b.tolist() for b in other][:1] != []  # refused: nothing changed, it plans afresh


def test_a_state_dict_outlives_its_collected_job():
    """The job of a checkpoint is collected (no trainer for --job-gc-timeout):
    a loader given the state makes a fresh job and goes on exactly."""
    with test_cluster(num_workers=1, dispatcher_flags=("--job-gc-timeout", "1")) as c:
        kwargs = dict(shuffle=True, seed=7, job_name="kept")
        whole, _ = run(c.address, kwargs)
        first, sd = run(c.address, kwargs, stop_at=30)
        with channel(c.address) as ch:
            stub = dgrpc.DispatcherStub(ch)
            wait_until(lambda: not [j for j in stub.GetStatus(dpb.GetStatusRequest(), timeout=5).jobs
                                    if j.name == "kept"], 30, "the job to be collected")
        rest, _ = run(c.address, kwargs, state=sd)
        assert first + rest == whole


def ddp_epoch(ranks, epoch, n=N, seed=7):
    """What torch's DistributedSampler gives each of ``ranks`` ranks in ``epoch``."""
    out = []
    for rank in range(ranks):
        sampler = tud.DistributedSampler(range(n), num_replicas=ranks, rank=rank, shuffle=True, seed=seed)
        sampler.set_epoch(epoch)
        out.append([b.tolist() for b in tud.DataLoader(range(n), batch_size=B, sampler=sampler)])
    return out


def lockstep(loaders, epoch, stop_at=None):
    """One epoch of every rank's loader, a batch of each in turn (as DDP steps
    them); stops after ``stop_at`` steps: each rank's batches."""
    got = [[] for _ in loaders]
    for dl in loaders:
        dl.set_epoch(epoch)
    for step, batches in enumerate(zip(*loaders)):
        for mine, batch in zip(got, batches):
            mine.append(batch.tolist())
        if step + 1 == stop_at:
            break
    return got


@pytest.mark.parametrize("before,after", [(2, 3), (4, 2)])
def test_an_elastic_resume_sees_every_sample_of_the_epoch_once(c, before, after):
    """N ranks checkpoint mid-epoch; M ranks, each given all N state dicts,
    see the samples no rank had seen, each once (DistributedSampler's padding
    aside), in equal shares; the next epoch is what M ranks plan. (2 ranks to
    1: test_ddp_resume.py, under torchrun.)"""
    def loaders(ranks, job):
        return [dpex.RemoteDataLoader(c.address, SPEC, batch_size=B, shuffle=True, seed=7, timeout=60,
                                      num_consumers=ranks, consumer_index=r, job_name=job)
                for r in range(ranks)]
    old = loaders(before, f"before-{before}")
    stop_at = random.randrange(1, len(old[0]))
    seen = lockstep(old, 0, stop_at)
    assert seen == [batches[:stop_at] for batches in ddp_epoch(before, 0)]
    states = [torch_roundtrip(dl.state_dict()) for dl in old]
    for dl in old:
        dl.close()
    new = loaders(after, f"after-{after}")
    for dl in new:
        dl.load_state_dict(states)
    rest = lockstep(new, 0)
    assert len({len(batches) for batches in rest}) == 1, "every rank gets as many batches"
    given = [i for batches in seen for b in batches for i in b]
    left = [i for batches in rest for b in batches for i in b]
    remaining = N - len(set(given))
    padding = 0 if remaining % after == 0 else after - remaining % after
    assert sorted(set(given) | set(left)) == list(range(N)) and not set(given) & set(left)
    assert len(left) == remaining + padding and len(set(left)) == remaining
    assert lockstep(new, 1) == ddp_epoch(after, 1), "the next epoch is what M ranks plan"
    for dl in new:
        dl.close()


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
def test_a_killed_trainer_resumes_from_its_checkpoint_exactly_once(request, tmp_path, meanwhile):
    path, out = str(tmp_path / "ckpt.pt"), str(tmp_path / "batches.txt")
    stop_at = random.randrange(5, 80)
    # only the trainer killed: the module's cluster; a worker or the dispatcher too: a cluster of its own
    own = meanwhile != "nothing"
    with (test_cluster(num_workers=2, work_dir=str(tmp_path / "work")) if own
          else contextlib.nullcontext(request.getfixturevalue("c"))) as c:
        first = programs.run(["-c", TRAINER, c.address, path, out, str(stop_at)], timeout=120)
        assert first.returncode == -signal.SIGKILL and "kill me" in first.stdout, first.stderr
        if meanwhile == "a worker is killed":
            c.kill_worker(0)
        elif meanwhile == "the dispatcher restarts":
            c.restart_dispatcher()
        second = programs.run(["-c", TRAINER, c.address, path, out, str(stop_at)], timeout=120)
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
