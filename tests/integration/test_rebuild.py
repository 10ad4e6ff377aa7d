"""A DpexDataLoader rebuilt from its own attributes, as frameworks rebuild
loaders (Lightning injects a DistributedSampler), and pickled to another
process, stays a Dpex loader (issue 44, its first part)."""
import pickle
import subprocess
import sys
import textwrap

import pytest
from torch.utils.data import DistributedSampler

import dpex
from dpex.testing.datasets import Squares


def ys(loader):
    return [b["y"].tolist() for b in loader]


def test_lightning_rebuilds_it_with_a_distributed_sampler_and_it_stays_a_dpex_loader(cluster):
    lightning_data = pytest.importorskip("pytorch_lightning.utilities.data")
    dl = dpex.DpexDataLoader(Squares(20), distribute_mode=True, head_address=cluster.address, batch_size=4,
                             num_workers=1, timeout=60)
    try:
        rebuilt = [lightning_data._update_dataloader(dl, DistributedSampler(dl.dataset, num_replicas=2, rank=r,
                                                                            shuffle=False))
                   for r in range(2)]
        for r, loader in enumerate(rebuilt):
            assert type(loader) is dpex.DpexDataLoader and loader.distribute_mode is True
            assert loader.dispatcher_address == cluster.address  # Dpex's workers make its batches
        shares = [ys(loader) for loader in rebuilt]
        assert sorted(y for share in shares for batch in share for y in batch) == list(range(20))
        assert shares[0][0] == [0, 2, 4, 6]  # DistributedSampler's share, as torch's DataLoader would read it
    finally:
        dl.close()
        for loader in locals().get("rebuilt", []):
            loader.close()


def test_it_keeps_its_arguments_under_their_names(cluster):
    dl = dpex.DpexDataLoader(Squares(8), distribute_mode=True, head_address=cluster.address, batch_size=4,
                             reproducible=False, timeout=60)
    try:
        assert (dl.distribute_mode, dl.head_address, dl.reproducible) == (True, cluster.address, False)
        again = type(dl)(dl.dataset, distribute_mode=dl.distribute_mode, head_address=dl.head_address,
                         batch_size=dl.batch_size, reproducible=dl.reproducible, timeout=dl.timeout)
        assert ys(again) == ys(dl) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        again.close()
    finally:
        dl.close()


@pytest.mark.parametrize("kind", ["DpexDataLoader", "RemoteDataLoader"])
def test_it_pickles_to_its_arguments_and_unpickles_to_a_new_loader_elsewhere(cluster, tmp_path, kind):
    if kind == "DpexDataLoader":
        dl = dpex.DpexDataLoader(Squares(8), distribute_mode=True, head_address=cluster.address, batch_size=4,
                                 timeout=60)
    else:
        dl = dpex.RemoteDataLoader(cluster.address, Squares(8), batch_size=4, timeout=60)
    try:
        (tmp_path / "loader.pkl").write_bytes(pickle.dumps(dl))  # locks, threads and channels need not travel
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            import pickle
            loader = pickle.load(open({str(tmp_path / "loader.pkl")!r}, "rb"))
            print(type(loader).__name__, [b["y"].tolist() for b in loader])
            """)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout == f"{kind} [[0, 1, 2, 3], [4, 5, 6, 7]]\n"
        assert ys(dl) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the original is untouched
    finally:
        dl.close()


def test_the_embedded_cluster_is_named_when_it_first_serves_not_when_a_loader_is_built(caplog, monkeypatch):
    # A framework may build a loader and drop it unused (it makes its own): that loader says nothing.
    import logging
    monkeypatch.delenv("DPEX_DISPATCHER", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    caplog.set_level(logging.INFO, logger="dpex.launch")
    unused = dpex.DpexDataLoader(Squares(8), distribute_mode=True, batch_size=4)
    unused.close()
    assert "loading on" not in caplog.text
    used = dpex.DpexDataLoader(Squares(8), distribute_mode=True, batch_size=4)
    try:
        assert ys(used) == [[0, 1, 2, 3], [4, 5, 6, 7]]
        said = [r.getMessage() for r in caplog.records if "embedded local cluster" in r.getMessage()]
        assert len(said) == 1 and f"dispatcher {used.dispatcher_address}" in said[0], said
        assert "head_address='auto'" in said[0]
    finally:
        used.close()
