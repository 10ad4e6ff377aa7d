"""The differential tester (dpex.testing.differential) in the suite: random
programs through torch's DataLoader and DpexDataLoader side by side, each
output and generator state compared (``benchmarks/differential.py`` runs the
long run); and the programs it found, shrunk, kept as regression tests."""
import pytest

from dpex.testing.differential import Config, Programs, Slot, replay, run

MAP = dict(iterable=False, length=20, batch_size=4, drop_last=False, shuffle=True, rng="generator",
           sampler="none", num_workers=0, persistent=False, in_order=True, collate=False, cache=False,
           share=True)


PROGRAMS, SHARDS = 300, 3  # the suite's programs, in three files of their own (test_programs_*.py):
# xdist's loadfile runs them on three workers at once instead of holding one for minutes.


def programs(address: str, shard: int) -> None:
    """Shard ``shard``'s programs, each shard others (a seed of its own), the same in every run."""
    before = Programs.programs
    run(address, programs=PROGRAMS // SHARDS, seed=shard)
    assert Programs.programs - before >= PROGRAMS // SHARDS


FOUND = {
    # Issue 55: RandomSampler's extra permutation was drawn at iter(): a peek or a break left the
    # user's generator one permutation ahead of torch's.
    "a peek, then an epoch": (MAP, [("peek", {}), ("iterate", {"slot": 0}), ("finish", {"data": Slot(0)})]),
    "a break, then an epoch": (dict(MAP, num_workers=2), [
        ("iterate", {"slot": 0}), ("next_", {"data": Slot(0)}), ("break_", {"data": Slot(0)}),
        ("iterate", {"slot": 1}), ("finish", {"data": Slot(1)})]),
    # Without workers torch draws an epoch's order at its first next(): zip's two epochs interleave.
    "zip without workers": (MAP, [("zip_", {}), ("peek", {})]),
    # A batch_sampler Dpex cannot describe was drawn whole at iter(), its sampler run out.
    "a batch sampler's generator": (dict(MAP, sampler="batch_sampler", num_workers=3), [
        ("iterate", {"slot": 0}), ("next_", {"data": Slot(0)})]),
    # Persistent workers: torch draws the base seed once; a state dict must carry it.
    "persistent workers through checkpoints": (dict(MAP, rng="global", num_workers=1, persistent=True), [
        ("iterate", {"slot": 0}), ("next_", {"data": Slot(0)}), ("checkpoint", {"through_json": True}),
        ("finish", {"data": Slot(0)}), ("peek", {})]),
    # Issue 55: a state dict with a generator was not JSON-safe.
    "a checkpoint through JSON mid-epoch": (dict(MAP, sampler="subset", num_workers=2), [
        ("iterate", {"slot": 0}), ("next_", {"data": Slot(0)}), ("checkpoint", {"through_json": True}),
        ("finish", {"data": Slot(0)}), ("iterate", {"slot": 1}), ("finish", {"data": Slot(1)})]),
    # An IterableDataset's stream ended at a batch's error (here collate_fn on batch_size=None's single
    # items); torch's worker raises it and goes on with the next item (found by the 4-wide long run).
    "an iterable stream goes on after a batch's error": (
        dict(MAP, iterable=True, length=5, batch_size=None, shuffle=False, sampler="none", num_workers=1,
             persistent=True, in_order=False, collate=True, cache=False), [
            ("iterate", {"slot": 0}), ("break_", {"data": Slot(0)}), ("iterate", {"slot": 0}),
            ("next_", {"data": Slot(0)}), ("set_epoch", {"epoch": 0}), ("next_", {"data": Slot(0)}),
            ("finish", {"data": Slot(0)})]),
    # A checkpoint loaded into the same loader, its iterator dropped: the dropped epoch's end (the reaper
    # thread's, later) released the resumed one, which has the same number.
    "a checkpoint into the same loader": (dict(MAP, num_workers=2, rng="global"), [
        ("iterate", {"slot": 0}), ("next_", {"data": Slot(0)}), ("checkpoint", {"through_json": False, "into": "same"}),
        ("next_", {"data": Slot(0)}), ("finish", {"data": Slot(0)}), ("iterate", {"slot": 1}),
        ("finish", {"data": Slot(1)})]),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_programs_the_tester_found_behave_as_torchs(cluster, name):
    config, steps = FOUND[name]
    replay(cluster.address, Config(**config), 1234, steps)


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("config", [dict(MAP, num_workers=2, rng="global"),
                                    dict(MAP, iterable=True, shuffle=False, num_workers=1)], ids=["map", "iterable"])
def test_a_loader_made_in_a_child_mid_epoch_behaves_as_torchs(cluster, config, method):
    """Issue 55: the tester's rarest step, always taken: a new loader in a child process while the
    parent's epoch is open (forked: torch's epoch or a clear error at once; spawned: torch's epoch)."""
    replay(cluster.address, Config(**config), 1234, [
        ("iterate", {"slot": 0}), ("next_", {"data": Slot(0)}), ("child", {"method": method}),
        ("finish", {"data": Slot(0)}), ("peek", {})])
