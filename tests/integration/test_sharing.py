"""Jobs of one definition (a sweep's trials) get each batch made once on a
worker, and every trial gets bitwise the batches it gets alone (the oracle:
the same loader with share=False): with sharing on and off, another seed,
a worker killed mid-epoch, and one trial resumed alone."""
import signal
import threading

import pytest

import dpex
from dpex.cmd.status import render
from dpex.proto import dispatcher_pb2 as dpb
from dpex.proto import dispatcher_pb2_grpc as dgrpc
from dpex.rpc import call, channel
from dpex.testing import test_cluster
from dpex.testing.cluster import wait_until
from dpex.testing.datasets import mixup

SPEC = dpex.DatasetSpec("dpex.testing.datasets:Augmented", n=96)
EPOCH = 96 // 4


def loader(address, **kw):
    args = dict(batch_size=4, shuffle=True, seed=7, collate_fn=mixup, timeout=60)
    return dpex.RemoteDataLoader(address, SPEC, **{**args, **kw})


def epochs(address, n=2, on_batch=None, **kw):
    out = []
    with loader(address, **kw) as dl:
        for _ in range(n):
            out.append([])
            for b in dl:
                out[-1].append((b["i"].tolist(), b["x"]))
                if on_batch is not None:
                    on_batch(len(out[-1]))
    return out


def same(a, b):
    return [[i for i, _ in e] for e in a] == [[i for i, _ in e] for e in b] and all(
        x.equal(y) for e, f in zip(a, b) for (_, x), (_, y) in zip(e, f))


def together(*runs):
    """Runs each of ``runs`` (a function) in a thread of its own, at once; their results."""
    out = [None] * len(runs)
    errors = []

    def run(k):
        try:
            out[k] = runs[k]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(runs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def status(c):
    return call(dgrpc.DispatcherStub(channel(c.address)).GetStatus, dpb.GetStatusRequest(), target="dispatcher",
                timeout_s=10)


def load(c):
    """The workers' counters summed, as their last heartbeats said."""
    alive = [w.load for w in status(c).workers if w.state == "alive"]
    return {f: sum(getattr(w, f) for w in alive) for f in ("batches_produced", "share_hits", "share_misses")}


def settled(c, sent):
    """The counters once the heartbeats report ``sent`` batches made or shared."""
    return wait_until(lambda: (lambda l: l if l["batches_produced"] >= sent else None)(load(c)), 30,
                      "the workers' counters")


@pytest.fixture(scope="module")
def one():
    with test_cluster(num_workers=1, processes=2) as c:
        yield c


def test_three_trials_pay_for_one_computation_and_each_gets_its_own_batches(one):
    alone = epochs(one.address, share=False)
    before = settled(one, 0)
    trials = together(*[lambda: epochs(one.address)] * 3)
    assert all(same(t, alone) for t in trials)
    after = settled(one, before["batches_produced"] + 3 * 2 * EPOCH)
    made = after["share_misses"] - before["share_misses"]
    shared = after["share_hits"] - before["share_hits"]
    assert made + shared == 3 * 2 * EPOCH and made <= 2 * 2 * EPOCH  # at least one trial's batches not made
    # `dpex status`: the trials' jobs share one label, the solo run (share=False) none; the worker's hits.
    now = status(one)
    labels = [j.shares for j in now.jobs]
    assert labels.count("") == 1 and max(labels.count(x) for x in set(labels) - {""}) == 3
    assert sorted(j.sharing for j in now.jobs) == ["off: share=False"] + ["with 2 jobs"] * 3  # and why
    text = render(now)
    assert "SHARES" in text and f"{after['share_hits']} (" in text and "off: share=False" in text


def test_share_false_or_another_seed_shares_nothing_and_changes_nothing(one):
    before = settled(one, 0)
    plain, opted_out, seeded = together(lambda: epochs(one.address, n=1), lambda: epochs(one.address, n=1, share=False),
                                        lambda: epochs(one.address, n=1, seed=8))
    assert same(plain, opted_out) and not same(plain, seeded)
    assert same(seeded, epochs(one.address, n=1, seed=8, share=False))
    after = settled(one, before["batches_produced"] + 4 * EPOCH)
    assert after["share_hits"] == before["share_hits"]
    # `dpex status` says why: another seed plans other batches; another batch size is another definition.
    with loader(one.address, batch_size=8, job_name="eights") as dl:
        list(dl)
    why = {j.name or j.job_id: j.sharing for j in status(one).jobs}
    assert why["eights"].startswith("none: job ") and why["eights"].endswith(" differs in batch_size")
    assert sum("of its definition plan other batches (another seed, epoch or sampler)" in w for w in why.values()) \
        >= 2  # seed 8 and seed 7 (plain), each beside the other


def test_a_worker_that_shares_nothing_makes_every_batch():
    with test_cluster(num_workers=1, processes=2, worker_flags=("--shm-min-kb", "0", "--share-cache-bytes", "0")) as c:
        trials = together(*[lambda: epochs(c.address, n=1)] * 2)
        assert same(trials[0], trials[1])
        counted = settled(c, 2 * EPOCH)
        assert (counted["batches_produced"], counted["share_hits"], counted["share_misses"]) == (2 * EPOCH, 0, 0)


def test_a_worker_killed_mid_epoch_while_shared_loses_and_repeats_nothing():
    with test_cluster(num_workers=2, processes=1) as c:
        alone = epochs(c.address, share=False)
        killed = threading.Event()

        def kill(seen):
            if seen == 5 and not killed.is_set():
                killed.set()
                c.kill_worker(0, signal.SIGKILL)
        trials = together(lambda: epochs(c.address, on_batch=kill), lambda: epochs(c.address))
        assert killed.is_set() and all(same(t, alone) for t in trials)


def test_one_trial_resumed_alone_gets_the_rest_of_its_epoch(one):
    alone = epochs(one.address, n=1, share=False)[0]
    saved = {}

    def first_trial():
        with loader(one.address) as dl:
            for k, b in enumerate(dl, 1):
                if k == 7:
                    saved["state"] = dl.state_dict()
                    return

    together(first_trial, lambda: epochs(one.address, n=1))
    with loader(one.address) as dl:
        dl.load_state_dict(saved["state"])
        rest = [(b["i"].tolist(), b["x"]) for b in dl]
    assert same([rest], [alone[7:]])
