"""Reproducible batches on any topology: a sample's random draws (torch,
numpy, random) and collate_fn's depend only on the epoch's base seed and the
sample's place in the plan, not on which worker or process makes it, nor on
failures, resume, batch size or (DistributedSampler) world size. Every
comparison is bitwise (float64 values compared exactly)."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

import dpex
from dpex.testing import datasets, oracle_context, test_cluster
from dpex.testing.compare import read_epochs

N, B = 96, 8
SPEC = dpex.DatasetSpec("dpex.testing.datasets:Augmented", n=N)


@pytest.fixture(scope="module")
def one():
    """One worker of one process."""
    with test_cluster(num_workers=1, processes=1) as c:
        yield c


@pytest.fixture(scope="module")
def many():
    """Three workers of two processes each."""
    with test_cluster(num_workers=3, processes=2) as c:
        yield c


def plain(batch):
    return {k: v.tolist() for k, v in batch.items()}


def epochs(address, n_epochs=2, stop_at=None, state=None, on_batch=None, **kw):
    """The batches of ``n_epochs`` epochs (shuffled, seeded, mixed by collate):
    all of them, or the first ``stop_at`` and a state dict."""
    kw = dict(dict(batch_size=B, shuffle=True, seed=5, collate_fn=datasets.mixup, timeout=60), **kw)
    with dpex.RemoteDataLoader(address, kw.pop("dataset", SPEC), **kw) as dl:
        return read_epochs(dl, n_epochs, value=lambda _, batch: plain(batch), stop_at=stop_at, state=state,
                           on_batch=on_batch)


def by_index(batches):
    """{sample index: its tensor} of default-collated batches (each index once)."""
    out = {}
    for batch in batches:
        for i, x in zip(batch["i"], batch["x"]):
            assert i not in out
            out[i] = x
    return out


def test_one_process_and_six_processes_on_three_workers_make_the_same_batches(one, many):
    reference, _ = epochs(one.address)
    assert len(reference) == 2 * N // B and reference[0] != reference[N // B]  # epochs draw anew
    assert epochs(many.address)[0] == reference
    # Today's behaviour, kept by reproducible=False: draws follow the process that made the batch.
    assert epochs(many.address, reproducible=False)[0] != epochs(one.address, reproducible=False)[0]


def test_the_embedded_cluster_makes_the_same_batches(one):
    assert epochs(None, processes=2)[0] == epochs(one.address)[0]


def test_a_worker_killed_mid_epoch_changes_no_draw(one):
    reference, _ = epochs(one.address)
    with test_cluster(num_workers=2, processes=2, heartbeat_timeout_s=60.0) as c:
        def kill(count):
            if count == 4:
                c.kill_worker(0, signal.SIGKILL)
        assert epochs(c.address, on_batch=kill)[0] == reference


def test_a_dispatcher_restarted_from_its_journal_changes_no_draw(one, tmp_path):
    reference, _ = epochs(one.address)
    with test_cluster(num_workers=2, processes=1, work_dir=str(tmp_path)) as c:
        def restart(count):
            if count == 5:
                c.restart_dispatcher()
        assert epochs(c.address, on_batch=restart)[0] == reference


@pytest.mark.parametrize("compact", [True, False], ids=["described", "explicit plan"])
def test_a_loader_resumed_at_batch_7_goes_on_with_the_same_draws(one, many, compact):
    reference, _ = epochs(one.address, compact_plans=compact)
    first, sd = epochs(one.address, stop_at=7, compact_plans=compact)
    rest, _ = epochs(many.address, state=sd, compact_plans=compact)  # elsewhere, with more processes
    assert first + rest == reference


def test_every_sample_is_the_same_with_batches_of_8_and_of_16(many):
    eight, _ = epochs(many.address, n_epochs=1, collate_fn=None)
    sixteen, _ = epochs(many.address, n_epochs=1, collate_fn=None, batch_size=16)
    assert by_index(eight) == by_index(sixteen) and len(by_index(eight)) == N


def ddp_ranks(address, world, name, states=None, stop_at=None):
    """One epoch of ``world`` ranks of one job (in one process: each rank's
    global RNG seeded alike, as a seeded DDP run's are), rank by rank; with
    ``stop_at``, each rank stops after that many batches: (batches, states)."""
    loaders = [dpex.RemoteDataLoader(address, SPEC, batch_size=4, shuffle=True, seed=3, num_consumers=world,
                                     consumer_index=r, job_name=name, timeout=60) for r in range(world)]
    got, out = [], []
    try:
        for loader in loaders:
            if states is not None:
                loader.load_state_dict(states)
            torch.manual_seed(0)  # every rank draws the epoch's base seed from a global RNG seeded alike
            for batch in loader:
                got.append(plain(batch))
                if stop_at is not None and sum(1 for _ in got) % stop_at == 0:
                    break
            out.append(loader.state_dict())
    finally:
        for loader in loaders:
            loader.close()
    return got, out


def test_ddp_on_2_ranks_resumed_on_3_gives_every_sample_the_same_draws(many):
    whole = by_index(ddp_ranks(many.address, 2, "repro-2")[0])
    assert len(whole) == N
    assert by_index(ddp_ranks(many.address, 3, "repro-3")[0]) == whole  # 3 ranks from the start: the same
    first, states = ddp_ranks(many.address, 2, "repro-2-stopped", stop_at=3)
    rest, _ = ddp_ranks(many.address, 3, "repro-2-on-3", states=states)
    assert by_index(first + rest) == whole


STREAM = dict(batch_size=4, num_workers=3, collate_fn=None, shuffle=False, seed=None)


@pytest.mark.parametrize("stateful", [False, True], ids=["run again", "state_dict"])
def test_an_iterable_dataset_resumed_mid_stream_draws_what_it_would_have(one, many, stateful):
    dataset = dpex.DatasetSpec("dpex.testing.datasets:AugmentedStream", n=60, stateful=stateful)
    torch.manual_seed(1)
    reference, _ = epochs(one.address, n_epochs=1, dataset=dataset, **STREAM)
    assert len(reference) == 15
    torch.manual_seed(1)
    first, sd = epochs(one.address, n_epochs=1, stop_at=7, dataset=dataset, **STREAM)
    rest, _ = epochs(many.address, n_epochs=1, state=sd, dataset=dataset, **STREAM)
    assert first + rest == reference


def test_an_iterable_datasets_streams_draw_as_torchs_workers(many):
    """torch's worker k of 3 is the oracle for stream k (from a forkserver: this process runs gRPC threads)."""
    def run(make):
        return [plain(b) for b in make(datasets.AugmentedStream(n=60), batch_size=4, num_workers=3,
                                       generator=torch.Generator().manual_seed(9))]
    want = run(lambda *a, **kw: DataLoader(*a, multiprocessing_context=oracle_context(), **kw))
    assert run(lambda *a, **kw: dpex.DpexDataLoader(*a, distribute_mode=True, head_address=many.address,
                                                   **kw)) == want


def test_the_trainers_rng_is_drawn_as_torchs_dataloader_draws_it(many):
    """The model's own draws (dropout, init) are then those of a torch run: the
    global RNG after iter(), mid-epoch and after the epoch, as torch leaves it."""
    def states(make):
        torch.manual_seed(42)
        loader = make(datasets.Augmented(n=N), batch_size=B, shuffle=True, num_workers=2)
        it = iter(loader)
        out = [torch.get_rng_state()]
        for i, _ in enumerate(it):
            if i == 3:
                out.append(torch.get_rng_state())
        out.append(torch.get_rng_state())
        iter(loader)  # the next epoch draws again
        out.append(torch.get_rng_state())
        return out
    want = states(lambda *a, **kw: DataLoader(*a, multiprocessing_context=oracle_context(), **kw))
    got = states(lambda *a, **kw: dpex.DpexDataLoader(*a, distribute_mode=True, head_address=many.address, **kw))
    assert all(torch.equal(g, w) for g, w in zip(got, want)) and len(got) == len(want) == 4


def test_user_code_reads_the_samples_seed(many):
    """dpex.sample_seed() / sample_generator() for code with generators of its own: keyed alike."""
    spec = dpex.DatasetSpec("dpex.testing.datasets:OwnGenerator", n=24)

    def run(batch_size):  # a loader iterated and dropped: its epoch keeps it alive, as torch's iterator does
        torch.manual_seed(0)
        return [plain(b) for b in dpex.RemoteDataLoader(many.address, spec, batch_size=batch_size, timeout=60)]
    one_batch, many_batches = run(24), run(3)
    assert len(one_batch) == 1 and len(many_batches) == 8
    assert by_index(one_batch) == by_index(many_batches)
    assert all(seed is not None for batch in one_batch for seed in batch["seed"])
    assert dpex.sample_seed() is None and dpex.sample_generator() is None  # in the trainer


SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "examples", "train_digits.py")


def train(address, tmp_path, name, *extra, check=True):
    """examples/train_digits.py with --augment, its loading on the cluster at ``address``."""
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "DPEX_DISPATCHER": address, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, SCRIPT, "--distribute", "--augment", "--epochs", "2", "--out", str(out),
                           *extra], env=env, capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(out.read_text())
    return done


def test_training_with_a_random_augmentation_ends_bitwise_alike_on_1_and_3_workers_and_after_a_kill(
        one, many, tmp_path):
    alone = train(one.address, tmp_path, "one")
    assert train(many.address, tmp_path, "many", "--num-workers", "3")["params"] == alone["params"]
    # Preempted after step 60 (checkpoints every 25 steps), then resumed on the other cluster.
    ckpt = ["--checkpoint", str(tmp_path / "ckpt.pt"), "--checkpoint-every", "25"]
    killed = train(one.address, tmp_path, "killed", *ckpt, "--kill-after", "60", check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train(many.address, tmp_path, "resumed", *ckpt, "--num-workers", "3")
    assert resumed["params"] == alone["params"] and resumed["losses"] == alone["losses"]
