"""dpex.worker.samples: samples kept by index and read back as they were;
the self-check catching a dataset that changes, naming the index; the
memory tier spilling to disk and the disk tier evicting within budgets."""
import pytest
import torch

from dpex.errors import DpexConfigError
from dpex.worker.samples import FIRST_CHECKS, SampleCache, tiers_bytes

SIZE = 4096 + 256  # about what one sample below encodes to


def sample(i):
    return {"i": i, "x": torch.full((1024,), float(i))}


def cache(tmp_path, memory=1 << 20, disk=1 << 20, check_every=1000):
    return SampleCache(str(tmp_path / "mem"), str(tmp_path / "disk"), memory, disk, check_every=check_every)


def test_a_sample_is_made_once_and_read_back_as_it_was(tmp_path):
    c, calls = cache(tmp_path), []

    def make(i):
        calls.append(i)
        return sample(i)
    for _ in range(3):
        for i in range(5):
            got = c.sample("memory", b"d", i, lambda i=i: make(i))
            assert got["i"] == i and got["x"].equal(sample(i)["x"])
    # Made once each, and again for the first hits' checks.
    assert (c.misses, c.hits) == (5, 10) and len(calls) == 5 + FIRST_CHECKS
    assert c.sample("memory", b"other", 0, lambda: sample(7))["i"] == 7  # another dataset, another sample


def test_a_dataset_that_changes_is_caught_naming_the_index(tmp_path):
    c = cache(tmp_path, check_every=3)
    draws = iter(range(100))
    c.sample("memory", b"d", 4, lambda: sample(next(draws)))
    with pytest.raises(DpexConfigError, match=r"dataset\[4\] is not what it was when it was cached"):
        c.sample("memory", b"d", 4, lambda: sample(next(draws)))
    steady = cache(tmp_path / "steady", check_every=3)  # and past the first hits, one in check_every
    for k in range(10):
        steady.sample("memory", b"d", 1, lambda: sample(1))
    assert steady.checked == FIRST_CHECKS + 3  # hits 1, 2, then 3, 6, 9


def test_the_memory_tier_spills_to_disk_and_the_disk_tier_evicts_within_their_budgets(tmp_path):
    c = cache(tmp_path, memory=8 * SIZE, disk=16 * SIZE)
    for i in range(64):
        c.sample("memory", b"d", i, lambda i=i: sample(i))
    memory, disk = tiers_bytes((str(tmp_path / "mem"),)), tiers_bytes((str(tmp_path / "disk"),))
    assert 0 < memory <= 8 * SIZE and 0 < disk <= 16 * SIZE
    kept = sorted(int(p.name.split("-")[1]) for d in ("mem", "disk") for p in (tmp_path / d).iterdir())
    assert kept[-1] == 63 and 0 not in kept  # the newest kept, the oldest gone
    misses = c.misses
    assert c.sample("memory", b"d", 63, lambda: sample(63))["i"] == 63 and c.misses == misses  # a hit


def test_a_disk_cache_keeps_nothing_in_memory(tmp_path):
    c = cache(tmp_path)
    c.sample("disk", b"d", 0, lambda: sample(0))
    assert tiers_bytes((str(tmp_path / "mem"),)) == 0 and tiers_bytes((str(tmp_path / "disk"),)) > 0


@pytest.mark.parametrize("draw", ["torch", "numpy", "random", "sample_seed"])
def test_a_sample_that_draws_is_never_kept_and_its_dataset_is_refused_everywhere(tmp_path, draw):
    """Issue 55: whether a sample drew is known from the generators' states, not by sampling hits."""
    import random

    import numpy as np

    import dpex
    draws = {"torch": lambda: torch.rand(1), "numpy": lambda: np.random.rand(), "random": random.random,
             "sample_seed": dpex.sample_seed}

    def make(i):
        if i == 3:
            draws[draw]()
        return sample(i)
    c = cache(tmp_path)
    for i in range(3):  # draw-free samples are kept
        c.sample("memory", b"d", i, lambda i=i: make(i))
    with pytest.raises(DpexConfigError, match=r"dataset\[3\] cannot be cached: it drew at random"):
        c.sample("memory", b"d", 3, lambda: make(3))
    assert c.misses == 4 and not (tmp_path / "mem" / f"{b'd'.hex()}-3").exists()
    # The dataset is refused from now on: its kept samples too, in this process and in another.
    for other in (c, cache(tmp_path)):
        with pytest.raises(DpexConfigError, match=r"dataset\[1\] cannot be cached: this dataset was found drawing"):
            other.sample("memory", b"d", 1, lambda: make(1))
    assert cache(tmp_path).sample("memory", b"another", 1, lambda: make(1))["i"] == 1
