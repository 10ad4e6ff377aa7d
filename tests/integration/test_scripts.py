"""Training scripts written the way people write them, each run as a script of
its own: once with torch's DataLoader, once with Dpex's (the import line
swapped), and what the two print compared. Torch's own suite cannot show
these: its datasets live in an importable test module, never in a script's
``__main__``."""
import subprocess
import sys
import textwrap

import pytest

TORCH = "from torch.utils.data import DataLoader\n"
DPEX = ("import dpex\n"
        "def DataLoader(*args, **kwargs):\n"
        "    return dpex.DpexDataLoader(*args, distribute_mode=True, **kwargs)\n")

# The seed's own examples have no main guard; neither do these, unless the pattern needs one.
MAP = """
import torch
from torch.utils.data import Dataset
{loader}
class Squares(Dataset):
    def __len__(self):
        return 20
    def __getitem__(self, i):
        return i * i
"""


def run(path, *args, timeout=180, cwd=None):
    done = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def both(tmp_path, body, *args, name="train.py", **kwargs):
    """What the script prints with torch's DataLoader and with Dpex's."""
    out = []
    for which, loader in (("torch", TORCH), ("dpex", DPEX)):
        folder = tmp_path / which
        folder.mkdir(exist_ok=True)
        script = folder / name
        script.write_text(textwrap.dedent(body).replace("{loader}", loader))
        out.append(run(script, *args, cwd=folder, **kwargs))
    assert out[0].strip(), "the script printed nothing"
    return out


def test_map_style_without_a_main_guard(tmp_path):
    torch_out, dpex_out = both(tmp_path, MAP + """
loader = DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2,
                    generator=torch.Generator().manual_seed(0))
for epoch in range(2):
    print([b.tolist() for b in loader])
""")
    assert torch_out == dpex_out


def test_iterable_without_a_main_guard(tmp_path):
    torch_out, dpex_out = both(tmp_path, """
import torch
from torch.utils.data import IterableDataset, get_worker_info
{loader}
class Stream(IterableDataset):
    def __iter__(self):
        info = get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(k, 20, n))
loader = DataLoader(Stream(), batch_size=4, num_workers=2, timeout=60)
print([b.tolist() for b in loader])
""")
    assert torch_out == dpex_out


def test_mp_spawn_with_the_dataset_in_the_script(tmp_path):
    torch_out, dpex_out = both(tmp_path, MAP + """
import torch.multiprocessing as mp

def run(rank, world):
    loader = DataLoader(Squares(), batch_size=5, num_workers=1)
    print(rank, [b.tolist() for b in loader], flush=True)

if __name__ == "__main__":
    mp.spawn(run, args=(1,), nprocs=1)
""")
    assert torch_out == dpex_out


def test_torchrun_with_the_dataset_in_the_script(tmp_path):
    body = MAP + """
import sys
import torch.distributed as dist
dist.init_process_group("gloo")
loader = DataLoader(Squares(), batch_size=5, num_workers=1)  # no sampler: every rank reads it all, as torch
# One write per line: under PYTHONUNBUFFERED a print's pieces are separate writes, and two ranks' lines interleave.
sys.stdout.write(f"{dist.get_rank()} {[b.tolist() for b in loader]}\\n")
sys.stdout.flush()
dist.destroy_process_group()
"""
    out = []
    for which, loader in (("torch", TORCH), ("dpex", DPEX)):
        folder = tmp_path / which
        folder.mkdir()
        (folder / "train.py").write_text(textwrap.dedent(body).replace("{loader}", loader))
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--log-dir", str(folder / "logs"), "train.py"], cwd=folder, capture_output=True,
                              text=True, timeout=180, stdin=subprocess.DEVNULL)
        assert done.returncode == 0, done.stderr[-4000:]
        out.append(sorted(done.stdout.splitlines()))
    assert out[0] == out[1] and len(out[0]) == 2


def test_a_dataset_from_a_module_beside_the_script_travels_by_value(tmp_path):
    # imgtrain.py beside train.py: a CLI worker cannot import it (its cwd is elsewhere).
    import dpex
    from dpex.testing import test_cluster
    (tmp_path / "imgtrain.py").write_text(textwrap.dedent("""
        from torch.utils.data import Dataset
        class Squares(Dataset):
            def __len__(self):
                return 10
            def __getitem__(self, i):
                return i * i
        """))
    with test_cluster(num_workers=1) as c:
        (tmp_path / "train.py").write_text(textwrap.dedent(f"""
            import dpex
            from imgtrain import Squares
            loader = dpex.DpexDataLoader(Squares(), distribute_mode=True, head_address={c.address!r},
                                         batch_size=5, timeout=60)
            print([b.tolist() for b in loader])
            """))
        assert run(tmp_path / "train.py", cwd=tmp_path) == "[[0, 1, 4, 9, 16], [25, 36, 49, 64, 81]]\n"
    assert dpex  # the test's own process imported it; the script's did too


def test_torchs_own_loader_beside_dpex_for_40_epochs(tmp_path):
    torch_out, dpex_out = both(tmp_path, """
import torch
import torch.utils.data as tud
from torch.utils.data import Dataset
{loader}
class Data(Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((8,), i)
train = DataLoader(Data(), batch_size=8, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(1))
validation = tud.DataLoader(Data(), batch_size=8, num_workers=2)  # torch's own, forked, while Dpex's threads run
for epoch in range(40):
    seen = [b[:, 0].tolist() for b in train]
    checked = sum(int(b.sum()) for b in validation)
    print(epoch, seen[0], checked)
""")
    assert torch_out == dpex_out


def test_torchs_own_loader_beside_dpex_prints_no_grpc_fork_warning(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(DPEX + textwrap.dedent("""
        import torch
        import torch.utils.data as tud
        train = DataLoader(list(range(64)), batch_size=8, num_workers=2)
        validation = tud.DataLoader(list(range(64)), batch_size=8, num_workers=2)
        for epoch in range(5):
            it = iter(train)
            next(it)  # Dpex's channels are busy while torch's workers fork
            assert sum(len(b) for b in validation) == 64
            print(sum(len(b) for b in it) + 8)
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == "64\n" * 5
    assert "fork" not in done.stderr and "goaway" not in done.stderr.lower(), done.stderr


def test_a_dpex_loader_collected_in_torchs_forked_worker_neither_hangs_it_nor_stops_the_parents(tmp_path):
    """Issue 58's flake: a loader (its iterator mid-epoch) left in a reference cycle is garbage, not yet
    collected, when torch's workers fork; a worker's collector then ran its finalizer, whose gRPC channel
    close waited for threads the child does not have: the worker hung for ever. Each finalizer now runs
    only in the process that made it: the parent's loaders and its embedded cluster are the parent's."""
    script = tmp_path / "train.py"
    script.write_text(DPEX + textwrap.dedent("""
        import gc
        import torch.utils.data as tud

        class Collects(tud.Dataset):  # a worker's allocations run the collector: made certain here
            def __len__(self):
                return 4
            def __getitem__(self, i):
                gc.collect()
                return i

        gc.disable()  # the garbage waits, as it may between two automatic collections
        for _ in range(2):
            train = DataLoader(list(range(64)), batch_size=8)
            it = iter(train)
            next(it)
            train.cycle, it.cycle = train, it  # garbage once dropped, till a collection
            del train, it
        validation = tud.DataLoader(Collects(), batch_size=2, num_workers=2, timeout=60)
        print(sorted(int(x) for b in validation for x in b))
        gc.enable()
        gc.collect()  # here, the parent's: its epochs end, its loaders close
        print(sum(len(b) for b in DataLoader(list(range(64)), batch_size=8)))  # the embedded cluster still runs
        """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout == "[0, 1, 2, 3]\n64\n", done.stderr[-4000:]


def test_a_worker_init_fn_that_seeds_torch_numpy_and_random(tmp_path):
    # torch's test_worker_init_fn: the sample sees the seed the user set, and torch.initial_seed() collates.
    torch_out, dpex_out = both(tmp_path, """
import random
import numpy as np
import torch
from torch.utils.data import Dataset
{loader}
class Draws(Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.initial_seed(), int(np.random.get_state()[1][0]), random.getstate()[1][0]
def init(worker_id):
    torch.manual_seed(12345)
    np.random.seed(7)
    random.seed(3)
loader = DataLoader(Draws(), batch_size=4, num_workers=2, worker_init_fn=init)
print([[t.tolist() for t in b] for b in loader])
unseeded = DataLoader(Draws(), batch_size=4, num_workers=2)
print(all(0 <= s < 2**63 for b in unseeded for s in b[0].tolist()))
""")
    assert torch_out == dpex_out


def test_persistent_workers_keep_the_dataset_of_the_first_iter(tmp_path):
    # torch's test_dataset_not_reset.
    torch_out, dpex_out = both(tmp_path, """
import torch
from torch.utils.data import Dataset
{loader}
class Data(Dataset):
    def __init__(self):
        self.start = 0
    def __len__(self):
        return 6
    def __getitem__(self, i):
        return self.start + i
for persistent in (True, False):
    data = Data()
    loader = DataLoader(data, batch_size=3, num_workers=2, persistent_workers=persistent)
    data.start = 10  # before the first iter(): seen either way
    for epoch in range(3):
        print(persistent, epoch, [b.tolist() for b in loader])
        data.start += 100
""")
    assert torch_out == dpex_out


def test_a_trainer_with_threads_of_its_own(tmp_path):
    torch_out, dpex_out = both(tmp_path, MAP + """
import threading
results = {}
def read(name, loader):
    results[name] = [b.tolist() for b in loader]
loaders = {name: DataLoader(Squares(), batch_size=5, num_workers=1) for name in ("a", "b")}
threads = [threading.Thread(target=read, args=item) for item in loaders.items()]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(sorted(results.items()))
""")
    assert torch_out == dpex_out


def test_code_run_by_exec_as_in_a_notebook(tmp_path):
    # No file behind __main__: Jupyter runs cells with exec.
    cell = MAP.replace("{loader}", "") + """
loader = DataLoader(Squares(), batch_size=5, num_workers=2)
print([b.tolist() for b in loader])
"""
    torch_out, dpex_out = both(tmp_path, f"{{loader}}\nexec({cell!r})\n")
    assert torch_out == dpex_out


def test_two_iterators_over_one_loader_and_a_peek_inside_the_loop(tmp_path):
    torch_out, dpex_out = both(tmp_path, MAP + """
# (Not with persistent_workers=True: torch's one persistent iterator, reset by each iter(), hangs in zip.)
loader = DataLoader(Squares(), batch_size=4, num_workers=2)
print([(a.tolist(), b.tolist()) for a, b in zip(loader, loader)])
seen = []
for i, batch in enumerate(loader):
    seen.append(batch.tolist())
    if i % 2 == 0:
        print("peek", next(iter(loader)).tolist())  # to log one batch: the loop's epoch goes on
print(seen)
""")
    assert torch_out == dpex_out


def test_a_resumed_epoch_takes_the_place_of_one_still_read_and_that_one_says_so(cluster):
    import dpex
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=40)
    with dpex.RemoteDataLoader(cluster.address, spec, batch_size=4, job_name="superseded", timeout=60) as loader:
        old = iter(loader)
        next(old)
        state = loader.state_dict()
        loader.load_state_dict(state)
        resumed = [b["y"].tolist() for b in loader]
        assert resumed == [list(range(i, i + 4)) for i in range(4, 40, 4)]
        with pytest.raises(dpex.DpexCancelledError, match="resumed from a state dict"):
            next(old)


def test_a_segfault_in_a_spawned_trainers_worker_is_reported_as_torchs(tmp_path):
    """torch's test_segfault: the trainer is itself a spawned child process."""
    torch_out, dpex_out = both(tmp_path, """
import ctypes, re
import torch.multiprocessing as mp
from torch.utils.data import Dataset
{loader}
class Segfaults(Dataset):
    def __len__(self):
        return 10
    def __getitem__(self, i):
        return ctypes.string_at(0)

def train(queue):
    try:
        next(iter(DataLoader(Segfaults(), batch_size=2, num_workers=2)))
    except RuntimeError as e:
        queue.put(str(e))

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    trainer = ctx.Process(target=train, args=(queue,))
    trainer.start()
    message = queue.get(timeout=120)
    trainer.join(60)
    print(trainer.exitcode, bool(re.search(r"DataLoader worker \\(pid\\(?s?\\)? \\d+(, \\d+)*\\) (is killed by signal|exited unexpectedly)", message)) or message)
""")
    assert torch_out == "0 True\n"  # else the message it gave
    assert dpex_out == "0 True\n"


def test_an_uncaught_worker_error_is_the_last_thing_printed(tmp_path):
    """Issue 55: after an uncaught error on the embedded cluster, the last line was the loader's
    "cannot reach dispatcher ... retrying until it is back" (its daemons stop at exit)."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import dpex
        from torch.utils.data import Dataset

        class Bad(Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                if i == 20:
                    raise ValueError("bad sample")
                return i

        for batch in dpex.DpexDataLoader(Bad(), distribute_mode=True, batch_size=4):
            pass
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "ValueError: bad sample", done.stderr[-2000:]
    assert "cannot reach" not in done.stderr
