"""Small datasets that worker processes can import by name."""
from __future__ import annotations

import os
import socket

import numpy as np
import torch
from torch.utils.data import Dataset


class Squares(Dataset):
    """Sample i is {"x": a small tensor derived from i, "y": i}."""

    def __init__(self, n: int = 100, dim: int = 3) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"x": torch.arange(self.dim, dtype=torch.float32) + i * i, "y": i}


class Faulty(Squares):
    """Raises ZeroDivisionError at index ``bad`` (the original project's BugDataset)."""

    def __init__(self, n: int = 100, bad: int = 13) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> dict:
        if i == self.bad:
            return 1 / 0  # type: ignore[return-value]
        return super().__getitem__(i)


class Crashing(Squares):
    """Its process dies of ``signum`` at index ``bad`` (a segfault in a decoder, an OOM kill)."""

    def __init__(self, n: int = 100, bad: int = 13, signum: int = 9) -> None:
        super().__init__(n)
        self.bad, self.signum = bad, signum

    def __getitem__(self, i: int) -> dict:
        if i == self.bad:
            import os
            os.kill(os.getpid(), self.signum)
        return super().__getitem__(i)


class BrokenInit(Dataset):
    def __init__(self, path: str = "/nonexistent") -> None:
        raise FileNotFoundError(f"no data at {path}")


class Where(Dataset):
    """Records where each sample was read: the host and the process."""

    def __init__(self, n: int = 40) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "host": socket.gethostname(), "pid": os.getpid()}


class Mixed(Dataset):
    """Samples with numpy arrays, strings and nested tuples."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple:
        return (np.full((2, 2), i, dtype=np.int16), f"s{i}", (torch.tensor(i, dtype=torch.bfloat16), i / 2))


class Slow(Squares):
    """Squares that take ``delay_s`` per sample, like a read from remote storage."""

    def __init__(self, n: int = 100, delay_s: float = 0.01) -> None:
        super().__init__(n)
        self.delay_s = delay_s

    def __getitem__(self, i: int) -> dict:
        import time
        time.sleep(self.delay_s)
        return super().__getitem__(i)


class SlowToBuild(Squares):
    """Squares whose building (on a worker) waits while the file ``path`` exists (at most a minute)."""

    def __init__(self, n: int, path: str) -> None:
        import os
        import time
        super().__init__(n)
        deadline = time.monotonic() + 60
        while os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.05)


class SlowWhile(Squares):
    """Squares that take ``delay_s`` per sample while the file ``path`` exists."""

    def __init__(self, n: int, path: str, delay_s: float = 0.5) -> None:
        super().__init__(n)
        self.path, self.delay_s = path, delay_s

    def __getitem__(self, i: int) -> dict:
        import os
        import time
        if os.path.exists(self.path):
            time.sleep(self.delay_s)
        return super().__getitem__(i)


class Gated(Squares):
    """Squares that wait until the file ``path`` exists: batches that stay
    running until a test lets them finish."""

    def __init__(self, n: int, path: str) -> None:
        super().__init__(n)
        self.path = path

    def __getitem__(self, i: int) -> dict:
        _wait_for(self.path)
        return super().__getitem__(i)


def _wait_for(path: str) -> None:
    """Blocks until the file ``path`` exists (a test's gate)."""
    import time
    while not os.path.exists(path):
        time.sleep(0.005)


class FilesIn(Dataset):
    """Sample i is the i-th file name under ``root`` (environment variables
    expanded on the worker: one path, each node's own files). With
    ``fingerprinted``, the dataset's fingerprint is a hash of its file list."""

    def __init__(self, root: str, fingerprinted: bool = False) -> None:
        import os
        self.files = sorted(os.listdir(os.path.expandvars(root)))
        if fingerprinted:
            import hashlib
            self.fingerprint = hashlib.sha256("\n".join(self.files).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> int:
        return int(self.files[i].split(".")[0])


class WorkerProbe(Dataset):
    """Each sample reports what torch's worker API says inside the worker."""

    def __init__(self, n: int = 32) -> None:
        self.n = n
        self.init_calls: list[int] = []
        self.seeded: dict = {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        info = torch.utils.data.get_worker_info()
        me = info.dataset
        return {"i": i, "id": info.id, "num_workers": info.num_workers, "seed": info.seed,
                "init_calls": len(me.init_calls), "torch_seed": me.seeded.get("torch", -1),
                "np_state": torch.tensor(me.seeded.get("np", [-1] * 4)), "pid": os.getpid()}


def record_worker_init(worker_id: int) -> None:
    """A worker_init_fn that records what torch's seeding left behind."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.init_calls.append(worker_id)
    info.dataset.seeded = {"torch": torch.initial_seed(), "np": np.random.get_state()[1][:4].tolist()}


class Big(Squares):
    """A dataset instance that carries ~6 MB of data."""

    def __init__(self) -> None:
        super().__init__(8)
        self.blob = np.ones(6 << 20, dtype=np.uint8)


class HeapChurn(Squares):
    """Each sample allocates and frees buffers as image decoding does (over
    glibc's default trim threshold, under the batch processes' mmap
    threshold) and says how many page faults that took in its process."""

    def __getitem__(self, i: int) -> dict:
        import resource
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(8):
            buf = bytearray(512 << 10)  # zero-filled: every page touched
            del buf
        return {"i": i, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}


class Counting(torch.utils.data.IterableDataset):
    """0..n-1, split across workers by get_worker_info() as torch's docs show."""

    def __init__(self, n: int = 50) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ids = range(self.n) if info is None else range(info.id, self.n, info.num_workers)
        for i in ids:
            yield {"i": i, "worker": -1 if info is None else info.id,
                   "seed": -1 if info is None else info.seed}

    def __len__(self) -> int:
        return self.n


class GatedCounting(Counting):
    """Counting that waits until the file ``path`` exists before each item:
    a stream that makes nothing until a test lets it."""

    def __init__(self, n: int, path: str) -> None:
        super().__init__(n)
        self.path = path

    def __iter__(self):
        for item in super().__iter__():
            _wait_for(self.path)
            yield item


class Uneven(torch.utils.data.IterableDataset):
    """Stream k of N yields ``per_stream * (k + 1)`` samples: streams end one after another."""

    def __init__(self, per_stream: int = 9) -> None:
        self.per_stream = per_stream

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k = 0 if info is None else info.id
        for j in range(self.per_stream * (k + 1)):
            yield {"i": k * 1000 + j, "seed": -1 if info is None else info.seed - info.id,
                   "r": torch.randint(0, 1 << 30, ()).item()}


class RankShards(torch.utils.data.IterableDataset):
    """Rank r's shard has ``sizes[r]`` samples (none past the list), r read from ``RANK`` as a
    torch DataLoader worker sees it under torchrun; split among a rank's streams as torch's
    workers split it (sample i to worker i mod N). Sample i of rank r is r * 1000 + i."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = list(sizes)

    def __iter__(self):
        rank = int(os.environ.get("RANK", 0))
        info = torch.utils.data.get_worker_info()
        k, n = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(k, self.sizes[rank] if rank < len(self.sizes) else 0, n):
            yield torch.tensor([rank * 1000 + i])


class StatefulUneven(Uneven):
    """Uneven with its own state_dict (torchdata's protocol): a resumed stream
    starts where its state says; samples tell where their stream started."""

    def __init__(self, per_stream: int = 9) -> None:
        super().__init__(per_stream)
        self.start = self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["pos"]

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        k = 0 if info is None else info.id
        for j in range(self.start, self.per_stream * (k + 1)):
            self.pos = j + 1
            yield {"i": k * 1000 + j, "start": self.start}


class Endless(torch.utils.data.IterableDataset):
    """An IterableDataset without __len__: 0, 1, 2, ... (stream k of N takes every N-th)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        i = info.id
        while True:
            yield i
            i += info.num_workers


class BrokenStream(Counting):
    def __iter__(self):
        for item in super().__iter__():
            if item["i"] == 7:
                raise ValueError("bad record 7")
            yield item


class NodeFiles(Dataset):
    """Reads sample i from ``ROOT/i.txt`` (default ``$DPEX_NODE_DATA``, expanded
    on the worker): each node has its own copy, and the file names the node it
    lives on, so a sample says who read it."""

    def __init__(self, n: int = 200, delay_s: float = 0.0, root: str = "$DPEX_NODE_DATA") -> None:
        self.n, self.delay_s, self.root = n, delay_s, root

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import time
        root = os.path.expandvars(self.root)
        if "$" in root:
            raise KeyError(f"{self.root} names an environment variable this worker does not have")
        with open(os.path.join(root, f"{i}.txt")) as f:
            node, index = f.read().split(":")
        time.sleep(self.delay_s)
        return {"i": int(index), "node": node}


class Cached(Dataset):
    """Every sample is the same uint8 image held in memory (a decoded cache)."""

    def __init__(self, n: int = 64, shape: tuple = (3, 224, 224)) -> None:
        self.n, self.image = n, torch.zeros(shape, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.image


class Sized(Dataset):
    """Sample i is ``sizes_mb[i % len(sizes_mb)]`` MiB of uint8, every byte i % 251."""

    def __init__(self, n: int, sizes_mb: tuple = (1, 7, 19, 33, 64)) -> None:
        self.n, self.sizes = n, sizes_mb

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((self.sizes[i % len(self.sizes)] << 20,), i % 251, dtype=torch.uint8)


class Augmented(Dataset):
    """A random augmentation drawn from all three global generators: sample i
    is {"i": i, "x": i + torch.rand(4) + np.random.rand(4) + random.random()}
    (float64, so that equal draws give bitwise-equal tensors), read in
    ``delay_s`` (as from storage)."""

    def __init__(self, n: int = 96, delay_s: float = 0.0) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import random
        import time
        time.sleep(self.delay_s)
        noise = torch.rand(4, dtype=torch.float64) + torch.from_numpy(np.random.rand(4)) + random.random()
        return {"i": i, "x": noise + i}


def mixup(samples: list) -> dict:
    """A collate_fn that draws too: each sample's x mixed with another's, by a random weight."""
    from torch.utils.data import default_collate
    batch = default_collate(samples)
    weight = torch.rand(len(samples), 1, dtype=torch.float64)
    partner = torch.randperm(len(samples))
    batch["x"] = weight * batch["x"] + (1 - weight) * batch["x"][partner]
    return batch


class AugmentedStream(torch.utils.data.IterableDataset):
    """An IterableDataset whose items draw from the global generators; stream
    k of N yields k, k + N, ... < n. With ``stateful``, it has a state_dict
    (a resumed stream goes on from where it was instead of running again)."""

    def __init__(self, n: int = 60, stateful: bool = False) -> None:
        self.n, self.stateful, self.next = n, stateful, None

    def __iter__(self):
        import random
        info = torch.utils.data.get_worker_info()
        k, step = (info.id, info.num_workers) if info is not None else (0, 1)
        start = self.next if self.next is not None else k
        for i in range(start, self.n, step):
            self.next = i + step
            noise = torch.rand(2, dtype=torch.float64) + float(np.random.rand()) + random.random()
            yield {"i": i, "x": noise + i}

    def __getattr__(self, name: str):
        if name in ("state_dict", "load_state_dict") and self.__dict__.get("stateful"):
            return {"state_dict": lambda: {"next": self.next},
                    "load_state_dict": lambda sd: setattr(self, "next", sd["next"])}[name]
        raise AttributeError(name)


class Noisy(Dataset):
    """Sample i: {"i": i, "x": torch.rand(4)}, an augmentation drawn from torch's global generator."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"i": i, "x": torch.rand(4, dtype=torch.float64)}


class Changing(Dataset):
    """Sample i changes each time it is made, with no random generator: {"i": i, "x": [i, calls so far]}."""

    def __init__(self, n: int = 24) -> None:
        self.n, self.calls = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        self.calls += 1
        return {"i": i, "x": torch.tensor([float(i), float(self.calls)])}


class OwnGenerator(Dataset):
    """Draws from a generator of its own, seeded by dpex.sample_seed()."""

    def __init__(self, n: int = 24) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        import dpex
        generator = dpex.sample_generator()
        return {"i": i, "x": torch.rand(3, generator=generator, dtype=torch.float64),
                "seed": dpex.sample_seed() & 0xFFFFFFFF}


class Regression(Dataset):
    """Sample i: (x of ``dim`` normal draws, y = x.sum() as a 1-vector, i, whether a Dpex batch process
    made it: dpex.sample_seed() is set there). For the framework tests: who made each batch, and a loss
    that falls."""

    def __init__(self, n: int = 64, dim: int = 4) -> None:
        self.n, self.dim = n, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple:
        import dpex
        x = torch.randn(self.dim)
        return x, x.sum().reshape(1), i, dpex.sample_seed() is not None


class Recorded(Dataset):
    """Sample i is {"i": i, "x": 8 float64 values of i}; each __getitem__ call
    appends i to the file ``path`` (from any process), to count them."""

    def __init__(self, n: int, path: str) -> None:
        self.n, self.path = n, path

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%d\n" % i)
        finally:
            os.close(fd)
        return {"i": i, "x": torch.full((8,), float(i), dtype=torch.float64)}


def _spin(cpu_s: float) -> None:
    """Busy on this process's CPU for ``cpu_s`` seconds of its CPU time."""
    import time
    start = time.process_time()
    while time.process_time() - start < cpu_s:
        pass


class Busy(Squares):
    """Squares that take ``cpu_s`` of CPU per sample, like a heavy decode or augmentation."""

    def __init__(self, n: int = 100, cpu_s: float = 0.01) -> None:
        super().__init__(n)
        self.cpu_s = cpu_s

    def __getitem__(self, i: int) -> dict:
        _spin(self.cpu_s)
        return super().__getitem__(i)


def busy_collate(samples: list, cpu_s: float = 0.05) -> dict:
    """default_collate after ``cpu_s`` of CPU: a heavy collate_fn (bind ``cpu_s`` with functools.partial)."""
    from torch.utils.data import default_collate
    _spin(cpu_s)
    return default_collate(samples)


class SlowCopy(Squares):
    """Squares whose worker's copy of the data is slow where the environment
    variable ``var`` says so: a read sleeps that many seconds a sample there."""

    def __init__(self, n: int = 100, var: str = "DPEX_TEST_SLOW_COPY_S") -> None:
        super().__init__(n)
        self.var = var

    def __getitem__(self, i: int) -> dict:
        import time
        time.sleep(float(os.environ.get(self.var, "0")))
        return super().__getitem__(i)


class Tokens(Dataset):
    """Variable-length "text": sample i is ``lengths[i]`` tokens (drawn from i, below ``vocab``)."""

    def __init__(self, lengths: list[int], vocab: int = 1000) -> None:
        self.lengths, self.vocab = list(lengths), vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        return {"i": i, "tokens": torch.randint(1, self.vocab, (self.lengths[i],), generator=g)}


class TokenStream(torch.utils.data.IterableDataset):
    """Tokens as a stream: rank r of R (``RANK``/``WORLD_SIZE``, as a torch worker sees them under
    torchrun) reads samples r, r + R, ... of ``lengths``, split among its streams as torch's workers
    split (every N-th). Each sample draws ``noise`` from torch's global generator."""

    def __init__(self, lengths: list[int], vocab: int = 1000) -> None:
        self.lengths, self.vocab, self.start = list(lengths), vocab, 0

    def __iter__(self):
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        info = torch.utils.data.get_worker_info()
        k, n = (0, 1) if info is None else (info.id, info.num_workers)
        mine = range(rank, len(self.lengths), world)[k::n]
        for j in range(self.start, len(mine)):
            self.pos = j + 1
            i = mine[j]
            g = torch.Generator().manual_seed(i)
            yield {"i": i, "tokens": torch.randint(1, self.vocab, (self.lengths[i],), generator=g),
                   "noise": torch.rand(())}

    def __len__(self) -> int:
        return len(self.lengths)


class StatefulTokenStream(TokenStream):
    """TokenStream with torchdata's state_dict: a resumed stream goes on from where it was."""

    pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.start = self.pos = state["pos"]


def pad_tokens(samples: list) -> dict:
    """Pads a batch of Tokens' samples to its longest (0: padding)."""
    longest = max(len(s["tokens"]) for s in samples)
    tokens = torch.zeros(len(samples), longest, dtype=torch.int64)
    for row, s in enumerate(samples):
        tokens[row, :len(s["tokens"])] = s["tokens"]
    batch = {"i": torch.tensor([s["i"] for s in samples]), "tokens": tokens}
    if "noise" in samples[0]:
        batch["noise"] = torch.stack([s["noise"] for s in samples])
    return batch


def heavy_tailed_lengths(n: int, seed: int = 0, cap: int = 512) -> list[int]:
    """Sequence lengths as real corpora have them: lognormal, a long tail, capped."""
    import numpy as np
    lengths = np.random.Generator(np.random.PCG64(seed)).lognormal(4.0, 0.9, n)
    return [int(x) for x in np.clip(lengths, 4, cap)]
