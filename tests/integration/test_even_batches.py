"""Uneven inputs under torchrun (issue 59): ranks whose data yields different numbers of
batches (an IterableDataset's shards, fewer shards than ranks, a batch_sampler of uneven
batches, drop_last both ways). With ``even_batches`` every rank gets the same number and
each step is a real all-reduce over the gloo group, which would hang on an uneven epoch;
without it, torch's counts and a warning that names them."""
import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch

from torch.utils.data import DataLoader

import dpex
from dpex.testing import test_cluster
from dpex.testing.datasets import RankShards

TRAIN = r"""
import json, os, sys, warnings
import torch, torch.distributed as dist
from torch.utils.data import BatchSampler
import dpex
from dpex.testing.datasets import RankShards, Squares

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def case(name, drop_last):
    if name == "shards":  # shards of different lengths, each in two streams (torch's two workers)
        return RankShards([10, 17, 7]), dict(batch_size=2, num_workers=2)
    if name == "fewer":  # fewer shards than ranks: the last rank has none
        return RankShards([9, 6][:world - 1]), dict(batch_size=2)
    indices = list(range(100 * rank, 100 * rank + 7 + 4 * rank))  # rank r: 7 + 4r samples
    return Squares(400), dict(batch_sampler=BatchSampler(indices, 3, drop_last))


results = []
for name, drop_last in json.loads(sys.argv[2]):
    for even in json.loads(sys.argv[3]):
        if name == "fewer" and even not in (False, "shortest"):
            continue  # "longest" has nothing of the empty rank's own to repeat: a clear error (test below)
        dataset, kw = case(name, drop_last)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dl = dpex.RemoteDataLoader(os.environ["DPEX_DISPATCHER"], dataset, timeout=60, even_batches=even, **kw)
            got = []
            for epoch in range(2):
                seen = []
                for batch in dl:
                    seen.append((batch["y"] if isinstance(batch, dict) else batch).view(-1).tolist())
                    if even is not False:  # a DDP step: every rank takes part, or all wait for ever
                        step = torch.ones(1)
                        dist.all_reduce(step)
                        assert step.item() == world
                got.append(seen)
            stats = dl.stats()
            dl.close()
        results.append(dict(case=name, drop_last=drop_last, even=even, got=got, dropped=stats.batches_dropped,
                            repeated=stats.batches_repeated,
                            warnings=[str(w.message) for w in caught if "different numbers of batches" in str(w.message)]))
        dist.barrier()
with open(f"{sys.argv[1]}.{rank}", "w") as f:
    json.dump(results, f)
dist.destroy_process_group()
"""

CASES = [["shards", False], ["fewer", False], ["sampler", False], ["sampler", True]]
RULES = [False, "shortest", True]


def own_batches(name, drop_last, rank, world):
    """What rank ``rank`` gets from its own data in an epoch: torch's DataLoader is the oracle."""
    if name == "sampler":
        indices = list(range(100 * rank, 100 * rank + 7 + 4 * rank))
        return [b for b in torch.utils.data.BatchSampler(indices, 3, drop_last)]
    dataset = RankShards([10, 17, 7] if name == "shards" else [9, 6][:world - 1])
    was = os.environ.get("RANK")
    os.environ["RANK"] = str(rank)  # as torchrun gives it to the rank, and the rank to its workers
    try:
        workers = dict(num_workers=2, multiprocessing_context="fork") if name == "shards" else {}
        loader = DataLoader(dataset, batch_size=2, **workers)
        return [b.view(-1).tolist() for b in loader]
    finally:
        if was is None:
            del os.environ["RANK"]
        else:
            os.environ["RANK"] = was


def torchrun(tmp_path, address, world):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    out = tmp_path / "out"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = subprocess.run([torchrun, "--standalone", f"--nproc_per_node={world}", "--log-dir", str(tmp_path / "elastic"),
                           str(script), str(out), json.dumps(CASES), json.dumps(RULES)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DPEX_DISPATCHER": address, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_ranks_under_torchrun_get_even_epochs_or_torchs_counts_and_a_warning(cluster, tmp_path, world):
    ranks = torchrun(tmp_path, cluster.address, world)
    by_run = [list(run) for run in zip(*ranks)]  # each loader's results, rank by rank
    assert len(by_run) == sum(1 for name, _ in CASES for even in RULES
                              if name != "fewer" or even in (False, "shortest"))
    for run in by_run:
        name, drop_last, even = run[0]["case"], run[0]["drop_last"], run[0]["even"]
        own = [own_batches(name, drop_last, r, world) for r in range(world)]
        for r, result in enumerate(run):
            for epoch in result["got"]:
                if even is False:  # torch's behaviour: each rank its own
                    assert epoch == own[r], (name, r)
                elif even == "shortest":
                    assert epoch == own[r][:min(map(len, own))], (name, r)
                else:  # "longest": its own, then its first batch again
                    assert epoch == own[r] + [own[r][0]] * (max(map(len, own)) - len(own[r])), (name, r)
            if even is True:
                assert result["repeated"] == 2 * (max(map(len, own)) - len(own[r]))
            if even != "shortest":
                assert result["dropped"] == 0
        if even is False:
            warned = [w for result in run for w in result["warnings"]]
            if len({len(b) for b in own}) > 1:
                assert warned, (name, drop_last)  # a DDP hang would have its cause on screen
            for w in warned:  # what each names is true (a rank that had not told all it has: "at least")
                named = re.findall(r"consumer (\d+): (at least )?(\d+)", w)
                assert len(named) >= 2, w
                for consumer, at_least, count in named:
                    told, has = int(count), len(own[int(consumer)])
                    assert (told <= has) if at_least else (told == has), w
        else:
            assert not any(result["warnings"] for result in run)


def test_a_rank_with_nothing_of_its_own_to_repeat_is_a_clear_error():
    """even_batches="longest" repeats a rank's own first batch: a rank whose shard is empty has none."""
    with test_cluster(num_workers=1) as c:
        errors, counts = {}, {}

        def rank(r):
            with dpex.RemoteDataLoader(c.address, Empty(), batch_size=2, num_consumers=2, consumer_index=r,
                                       job_name="nothing to repeat", timeout=30, even_batches="longest") as dl:
                try:
                    counts[r] = len(list(dl))
                except dpex.DpexConfigError as e:
                    errors[r] = str(e)
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert counts == {0: 3}
    assert "consumer 1 of job" in errors[1] and "no batch of its own" in errors[1] and "shortest" in errors[1]


class Empty(torch.utils.data.IterableDataset):
    """Consumer 0's shard has 5 samples, consumer 1's none (RANK as its stream sees it)."""

    def __iter__(self):
        yield from range(5 if int(os.environ["RANK"]) == 0 else 0)


def test_a_rank_resumed_while_it_repeats_goes_on_repeating_its_first_batch_bitwise():
    """even_batches="longest", a short rank checkpointed after its own batches ran out: the resumed loader
    fetches its epoch's first batch again (made again, bitwise: keyed draws) and repeats it, as the
    uninterrupted run did (before: "no batch of its own to repeat")."""
    from torch.utils.data import BatchSampler

    from dpex.testing.datasets import Augmented
    sizes = {0: 5, 1: 14}  # rank 0: 2 batches of its own, rank 1: 5; rank 0 repeats its first 3 times

    def loader(address, r, name):
        sampler = BatchSampler(list(range(100 * r, 100 * r + sizes[r])), 3, False)
        return dpex.RemoteDataLoader(address, Augmented(400), batch_sampler=sampler, num_consumers=2, consumer_index=r,
                                     job_name=name, timeout=60, even_batches="longest",
                                     generator=torch.Generator().manual_seed(4))

    def plain(b):
        return b["i"].tolist(), b["x"].numpy().tobytes()

    with test_cluster(num_workers=2) as c:
        want, done = {}, threading.Event()

        def whole(r):
            with loader(c.address, r, "whole") as dl:
                want[r] = [plain(b) for b in dl]
        threads = [threading.Thread(target=whole, args=(r,)) for r in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert len(want[0]) == len(want[1]) == 5 and want[0][2:] == [want[0][0]] * 3

        def long_rank():
            with loader(c.address, 1, "resumed") as dl:
                want["long"] = [plain(b) for b in dl]
                done.wait(120)  # its count stays told while rank 0 resumes
        other = threading.Thread(target=long_rank)
        other.start()
        with loader(c.address, 0, "resumed") as dl:
            it = iter(dl)
            got = [plain(next(it)) for _ in range(3)]  # its own two, and one repeat
            state = dl.state_dict()
        with loader(c.address, 0, "resumed") as dl:
            dl.load_state_dict(state)
            got += [plain(b) for b in dl]
            stats = dl.stats()
        done.set()
        other.join()
    assert got == want[0] and want["long"] == want[1]
    assert stats.batches_repeated == 2
