"""The embedded cluster's worker is forked from the trainer, as torch's
DataLoader forks its workers (its batch processes then need no cold import
of torch), unless gRPC already runs threads in the trainer or the loader asks
for "spawn". Each scenario is a new process that has run nothing yet, as a
user's script is (forked warm: dpex.testing.programs; the one of a script that
spawn imports again is a new interpreter); torch's DataLoader in the same
script is the oracle for the batches."""
import json
import textwrap

import pytest

from dpex.testing import programs

PRELUDE = textwrap.dedent("""
    import json, os, sys, threading
    import torch
    from torch.utils.data import DataLoader, Dataset
    import dpex
    from dpex.testing import descendants

    class Noisy(Dataset):  # in __main__: shipped by value
        def __len__(self):
            return 40

        def __getitem__(self, i):
            if i == 13:
                raise KeyError(f"no sample {i}")
            return torch.tensor([i, i * i])

    def epoch(loader):
        out, it = [], iter(loader)
        while True:
            try:
                out.append(next(it).tolist())
            except KeyError:
                out.append("KeyError")
            except StopIteration:
                return out

    def kinds():
        # What started each process of the embedded cluster: the trainer's own
        # command line (forked), or a daemon's / a spawned process's.
        mine = open("/proc/self/cmdline").read()
        out = {}
        for pid in descendants(os.getpid()):
            try:
                cmd = open(f"/proc/{pid}/cmdline").read()
            except OSError:  # exited since it was listed (a torch worker or a stream's process ending)
                continue
            kind = ("forked" if cmd == mine else "dispatcher" if "dpex.cmd.dispatcher" in cmd
                    else "worker" if "dpex.cmd.worker" in cmd else "spawned")
            out[kind] = out.get(kind, 0) + 1
        return out

    def loaders(**kw):
        # torch's without processes: the same batches, and no fork or spawn of a script given with -c
        make = lambda cls, **more: cls(Noisy(), batch_size=4, shuffle=True,
                                       generator=torch.Generator().manual_seed(7), **more)
        return make(DataLoader), make(dpex.DpexDataLoader, distribute_mode=True, **kw)
""")


def run(body: str, *args: str) -> dict:
    out = programs.run(["-c", PRELUDE + textwrap.dedent(body), *args], timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_embedded_worker_is_forked_from_the_trainer_and_gives_torchs_batches():
    got = run("""
        torch_loader, dpex_loader = loaders(num_workers=2)
        want = epoch(torch_loader)
        got = epoch(dpex_loader)
        print(json.dumps(dict(want=want, got=got, again=epoch(dpex_loader), kinds=kinds())))
    """)
    assert got["got"] == got["want"] and got["again"] != got["want"]  # a new shuffle, as torch's
    assert "KeyError" in got["want"]
    # The worker daemon, its two batch processes and its streams' forkserver are forks of the trainer; the
    # dispatcher is spawned.
    assert got["kinds"] == {"forked": 4, "dispatcher": 1}


def test_a_trainer_where_grpc_runs_threads_spawns_its_worker_instead():
    got = run("""
        import grpc
        channel = grpc.insecure_channel("127.0.0.1:1")
        try:
            grpc.channel_ready_future(channel).result(timeout=0.2)  # gRPC's threads start
        except grpc.FutureTimeoutError:
            pass
        from dpex.daemon import can_fork
        torch_loader, dpex_loader = loaders(num_workers=1, multiprocessing_context=sys.argv[1])
        want = epoch(torch_loader)
        print(json.dumps(dict(can_fork=can_fork(), want=want, got=epoch(dpex_loader), kinds=kinds())))
    """, "spawn")
    assert got["can_fork"] is False
    assert got["got"] == got["want"]
    spawned(got["kinds"])


def spawned(kinds: dict) -> None:
    """A spawned worker daemon, its batch process and its streams' forkserver, which the daemon forked
    (so they have the daemon's command line); nothing forked from the trainer."""
    assert "forked" not in kinds and kinds["dispatcher"] == 1 and kinds["worker"] == 3


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_loader_that_asks_for_another_start_method_spawns_its_worker(context):
    got = run("""
        torch_loader, dpex_loader = loaders(num_workers=1, multiprocessing_context=sys.argv[1])
        print(json.dumps(dict(want=epoch(torch_loader), got=epoch(dpex_loader), kinds=kinds())))
    """, context)
    assert got["got"] == got["want"]
    spawned(got["kinds"])


def test_a_loader_made_in_a_thread_that_ends_keeps_its_forked_worker():
    """Forked from a thread that ends: the worker watches the trainer's pid,
    not the forking thread (PR_SET_PDEATHSIG would have stopped it)."""
    got = run("""
        made = []
        maker = threading.Thread(target=lambda: made.append(loaders(num_workers=1)))
        maker.start()
        maker.join()
        torch_loader, dpex_loader = made[0]
        want = epoch(torch_loader)
        first = epoch(dpex_loader)
        again = dpex.DpexDataLoader(list(range(5)), distribute_mode=True, batch_size=2, num_workers=1)
        print(json.dumps(dict(want=want, got=first, again=[b.tolist() for b in again], kinds=kinds())))
    """)
    assert got["got"] == got["want"]
    assert got["again"] == [[0, 1], [2, 3], [4]]
    assert got["kinds"] == {"forked": 3, "dispatcher": 1}  # the worker, its batch process, its forkserver


def test_a_forked_batch_process_that_dies_is_reported_and_the_pool_starts_again():
    """After a crash the worker runs gRPC threads: its new processes are spawned, and serve the next epoch."""
    got = run("""
        class Segfaults(Dataset):
            def __init__(self):
                self.crash = True

            def __len__(self):
                return 8

            def __getitem__(self, i):
                if i == 5 and self.crash:
                    import ctypes
                    ctypes.string_at(0)
                return i

        data = Segfaults()
        loader = dpex.DpexDataLoader(data, distribute_mode=True, batch_size=2, num_workers=1, timeout=120)
        first, error = [], ""
        try:
            for batch in loader:
                first.append(batch.tolist())
        except RuntimeError as e:
            error = str(e)
        data.crash = False  # taken at the next iter()
        print(json.dumps(dict(first=first, error=error, again=[b.tolist() for b in loader], kinds=kinds())))
    """)
    assert got["first"] == [[0, 1], [2, 3]]
    assert "is killed by signal: Segmentation fault. It was making this batch, reading dataset[5]" in got["error"]
    assert got["again"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # the worker and its forkserver; its new batch process
    assert got["kinds"]["forked"] == 2 and got["kinds"]["spawned"] >= 1


def test_an_iterable_dataset_on_a_forked_worker_of_a_trainer_that_ran_a_forkserver():
    """Streams are forked from the worker's own forkserver (forked from the worker as it started), not the
    trainer's (which the fork copied)."""
    got = run("""
        from dpex.testing.datasets import AugmentedStream
        def epoch(loader):
            return [[b["i"].tolist(), [round(v, 12) for v in b["x"].flatten().tolist()]] for b in loader]
        make = lambda cls, **kw: cls(AugmentedStream(n=12), batch_size=2, num_workers=2,
                                     generator=torch.Generator().manual_seed(4), **kw)
        want = epoch(make(DataLoader, multiprocessing_context="forkserver"))
        print(json.dumps(dict(want=want, got=epoch(make(dpex.DpexDataLoader, distribute_mode=True)),
                              kinds=kinds())))
    """)
    assert got["got"] == got["want"] and len(got["want"]) == 6  # torch's workers are the oracle for the draws
    assert got["kinds"]["forked"] == 4  # the worker, its batch processes and its forkserver (none spawned)


def test_a_forked_child_of_a_process_that_used_dpex_fails_at_once_and_a_spawned_one_works(tmp_path):
    """Issue 55 (torch's test_segfault's case): gRPC hangs in a child forked from a process where it
    runs; the child's loader says so at once, and one in a spawned child loads as in a fresh process."""
    script = tmp_path / "script.py"  # a file: spawn's child imports the script again (under a main guard)
    script.write_text(PRELUDE + textwrap.dedent("""
        import multiprocessing, time

        def child(q):
            try:
                loader = dpex.DpexDataLoader(list(range(8)), distribute_mode=True, batch_size=4)
                q.put([b.tolist() for b in loader])
            except dpex.DpexError as e:
                q.put(str(e))

        if __name__ == "__main__":
            parent = dpex.DpexDataLoader(list(range(8)), distribute_mode=True, batch_size=4)
            assert [b.tolist() for b in parent] == [[0, 1, 2, 3], [4, 5, 6, 7]]
            got = {}
            for method in ("fork", "spawn"):
                q = multiprocessing.get_context(method).Queue()
                p = multiprocessing.get_context(method).Process(target=child, args=(q,))
                start = time.monotonic()
                p.start()
                got[method] = q.get(timeout=120)
                p.join(60)
                got[method + "_s"] = time.monotonic() - start
            print(json.dumps(got))
    """))
    done = programs.run([str(script)], timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "forked from one where Dpex had run" in out["fork"] and "'spawn'" in out["fork"]
    assert out["fork_s"] < 10
    assert out["spawn"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
