"""The data of any step on demand (issue 59): ``loader.plan_of(step)`` names what every rank
gets at a step, as a run that took the step got it (torch's DataLoader the oracle), and
``loader.skip(steps)`` passes over steps exactly once, through a state dict's resume."""
import io

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import dpex
from dpex.testing import test_cluster
from dpex.testing.datasets import Squares

N, B = 90, 4


@pytest.fixture(scope="module")
def c():
    with test_cluster(num_workers=2) as cluster:
        yield cluster


def ys(batches):
    return [b["y"].tolist() for b in batches]


@pytest.mark.parametrize("sampler", ["ShuffleSampler", "DistributedSampler"])
def test_plan_of_names_what_every_rank_gets_at_each_step(c, sampler):
    world = 3

    def make(rank):
        if sampler == "ShuffleSampler":
            return dpex.ShuffleSampler(N, seed=5, num_replicas=world, rank=rank)
        return DistributedSampler(Squares(N), num_replicas=world, rank=rank, shuffle=True, seed=5)
    torch_ranks = [ys(DataLoader(Squares(N), batch_size=B, sampler=make(r))) for r in range(world)]
    with dpex.RemoteDataLoader(c.address, Squares(N), batch_size=B, sampler=make(0), num_consumers=1,
                               timeout=60) as dl:
        with pytest.raises(dpex.DpexConfigError, match="no epoch was begun"):
            dl.plan_of(0)
        got = ys(dl)
        assert got == torch_ranks[0]
        for step in range(len(got)):
            assert dl.plan_of(step) == {r: torch_ranks[r][step] for r in range(world)}
        with pytest.raises(dpex.DpexConfigError, match=f"step {len(got)} is not in epoch 0"):
            dl.plan_of(len(got))
        # Any epoch of an order that follows set_epoch: as torch's loader plans it after set_epoch(4).
        samplers = [make(r) for r in range(world)]
        for s in samplers:
            s.set_epoch(4)
        later = [ys(DataLoader(Squares(N), batch_size=B, sampler=s)) for s in samplers]
        assert later != torch_ranks
        for step in range(len(got)):
            assert dl.plan_of(step, epoch=4) == {r: later[r][step] for r in range(world)}


def test_an_order_drawn_anew_each_epoch_has_only_the_epoch_in_progress_to_read(c):
    with dpex.RemoteDataLoader(c.address, Squares(N), batch_size=B, shuffle=True, timeout=60) as dl:
        it = iter(dl)
        first = next(it)
        assert dl.plan_of(0) == {0: first["y"].tolist()}
        with pytest.raises(dpex.DpexConfigError, match="only the epoch in progress has a plan to read"):
            dl.plan_of(0, epoch=3)
        del it


def test_skipped_steps_are_never_given_and_stay_skipped_through_a_resume(c):
    sampler = dpex.ShuffleSampler(N, seed=9)
    whole = ys(DataLoader(Squares(N), batch_size=B, sampler=sampler))  # 23 steps
    kw = dict(batch_size=B, sampler=sampler, timeout=60, job_name="skips")
    with dpex.RemoteDataLoader(c.address, Squares(N), **kw) as dl:
        it = iter(dl)
        first = ys(next(it) for _ in range(3))  # steps 0-2
        with pytest.raises(dpex.DpexConfigError, match="not all ahead"):
            dl.skip(range(1, 4))  # step 1 was given
        assert dl.skip(range(3, 6)) == 3  # a loss spike: steps 3-5 passed over
        first += ys(next(it) for _ in range(2))  # steps 6-7
        state = io.BytesIO()
        torch.save(dl.state_dict(), state)
        del it
    with dpex.RemoteDataLoader(c.address, Squares(N), **kw) as dl:
        state.seek(0)
        dl.load_state_dict(torch.load(state))
        it = iter(dl)
        rest = ys([next(it)])  # step 8
        assert dl.skip(2) == 2  # steps 9-10
        rest += ys(it)
        assert dl.stats().batches == len(rest)
    assert first + rest == whole[:3] + whole[6:9] + whole[11:]
    with pytest.raises(dpex.DpexConfigError, match="no epoch is in progress"):
        dl.skip(1)
