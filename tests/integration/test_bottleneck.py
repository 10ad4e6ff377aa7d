"""The injected-bottleneck suite (issue 56): a real cluster on this machine,
a bottleneck put where a user's pipeline would have it, and the verdict of
``loader.stats()`` checked: the stage named, the reason in words."""
import functools
import time

import pytest

import dpex
from dpex.testing import datasets, test_cluster

B = 4


@pytest.fixture(scope="module")
def cluster():
    with test_cluster(num_workers=2) as c:
        yield c


def verdict(address, dataset, step_s=0.0, batches=None, **kw):
    """An epoch (or its first ``batches``) through a loader; the trainer's step takes ``step_s``."""
    with dpex.RemoteDataLoader(address, dataset, batch_size=B, timeout=60, **kw) as dl:
        for n, _ in enumerate(dl, 1):
            time.sleep(step_s)
            if n == batches:
                break
        return dl.stats()


def test_a_cpu_heavy_dataset_calls_for_workers_and_names_the_dataset(cluster):
    stats = verdict(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Busy", n=80, cpu_s=0.01))
    assert stats.bottleneck == "workers", stats.bottleneck_reason
    assert stats.stages["dataset"] > stats.stages["collate"] + stats.stages["dpex"]
    assert "add workers" in stats.bottleneck_reason and "the dataset's code" in stats.bottleneck_reason


def test_a_dataset_that_sleeps_on_storage_calls_for_processes(cluster):
    stats = verdict(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Slow", n=80, delay_s=0.01))
    assert stats.bottleneck == "storage", stats.bottleneck_reason
    assert "--processes" in stats.bottleneck_reason
    assert stats.stages["dataset_cpu"] < stats.stages["dataset"] / 2


def test_a_heavy_collate_fn_calls_for_workers_and_names_collation(cluster):
    stats = verdict(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=80),
                    collate_fn=functools.partial(datasets.busy_collate, cpu_s=0.04))
    assert stats.bottleneck == "workers", stats.bottleneck_reason
    assert stats.stages["collate_cpu"] > 0.03 and "collate_fn" in stats.bottleneck_reason
    assert max(("dataset", "collate", "dpex"), key=stats.stages.get) == "collate"


def test_a_slow_training_step_needs_nothing(cluster):
    stats = verdict(cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares", n=80), step_s=0.02)
    assert stats.bottleneck == "none", stats.bottleneck_reason
    assert "buy nothing" in stats.bottleneck_reason and stats.predict(4) <= stats.batches_per_s * 1.01


def test_one_worker_with_a_slow_copy_of_the_data_is_named_the_straggler():
    with test_cluster(num_workers=1) as c:
        slow = c.add_workers(1, env={"DPEX_TEST_SLOW_COPY_S": "0.01"})[0]
        stats = verdict(c.address, dpex.DatasetSpec("dpex.testing.datasets:SlowCopy", n=160))
        assert stats.bottleneck == "straggler", stats.bottleneck_reason
        assert slow.address in stats.bottleneck_reason and c.worker_addresses[0] not in stats.bottleneck_reason
