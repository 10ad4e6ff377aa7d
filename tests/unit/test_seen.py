"""dpex.client.seen: the dataset a plan is made for, and the check that
every worker's copy is that dataset."""
import pytest
import torch.utils.data as tud

from dpex.client import seen as seen_module
from dpex.errors import DpexConfigError, DpexConnectionError


class Fingerprinted(tud.Dataset):
    fingerprint = "v2"

    def __len__(self):
        return 7


class Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def test_the_trainers_instance_gives_its_length_fingerprint_and_kind():
    assert seen_module.in_trainer(Fingerprinted())[1:] == (7, "v2", False)
    assert seen_module.in_trainer(Stream())[1:] == (-1, "", True)


def test_a_worker_whose_copy_differs_is_named_with_both_lengths_and_fingerprints():
    seen = seen_module.DatasetSeen("worker a:1", 7, "v2")
    seen.check(3, "b:2", 7, "v2")
    with pytest.raises(DpexConfigError, match=r"worker a:1 has 7 samples \(fingerprint 'v2'\), worker b:2 has 7 "
                                              r"\(fingerprint 'v1'\)"):
        seen.check(3, "b:2", 7, "v1")
    with pytest.raises(DpexConfigError, match="job 3: worker a:1 has 7 samples, worker b:2 has 8"):
        seen.check(3, "b:2", 8, "v2")


def test_with_no_worker_it_waits_its_time_then_says_so():
    asked = []
    with pytest.raises(DpexConnectionError, match=r"no worker is registered with dispatcher x:1 \(waited 0.3s\)"):
        seen_module.on_workers(lambda: asked.append(1) or [], 1, b"", None, None, 0.3, "dispatcher x:1")
    assert len(asked) >= 2  # asked again while it waited


def test_an_unreachable_worker_is_passed_over_for_the_others():
    with pytest.raises(DpexConnectionError, match="no worker is registered"):
        seen_module.on_workers(lambda: ["127.0.0.1:1"], 1, b"", None, None, 0.0, "dispatcher x:1")
