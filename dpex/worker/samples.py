"""A worker's sample cache (a loader's ``cache="memory"`` or ``"disk"``): the
samples of a dataset that does not change between epochs (a validation set,
a decode whose output collate_fn augments), kept by index across epochs and
across jobs of the same dataset, shared by the worker's batch processes.

A sample is a file (dpex.wire's encoding) named by the dataset's digest and
its index, in a memory tier (the worker's /dev/shm directory) and a disk
tier (its temp directory). ``"memory"`` fills the memory tier, spills its
oldest samples to the disk tier past ``memory_bytes``, and evicts the disk
tier's oldest past ``disk_bytes``; ``"disk"`` keeps only the disk tier.

A sample that draws at random is never kept: whether making it drew from
torch's, numpy's or ``random``'s global generator (or read
``dpex.sample_seed()``) is known exactly, from their states before and
after (dpex.seeding.drew_since). Such a sample raises an error naming its
index, and its dataset is marked as drawing (a file beside the disk tier's
samples), so every later sample of it, in any process, epoch or job on this
worker, is refused too: never wrong data in silence. For draws the states
cannot show (a generator seeded from the OS's entropy), the first hits of
each dataset in a process, then one in ``check_every``, are computed again
and compared byte for byte.
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Callable

from dpex.errors import DpexConfigError

KINDS = ("memory", "disk")
FIRST_CHECKS = 2     # hits of a dataset checked in each process before checking one in check_every
_SCAN_EVERY = 1 / 16  # of a tier's budget written by this process before it adds up the tier again


_DRAWS = ("cache: dataset[{index}] cannot be cached: {how} (torch's, numpy's or random's generator, or "
          "dpex.sample_seed()), so its samples change between epochs; move the random part to collate_fn, "
          "or leave cache unset")


class SampleCache:
    def __init__(self, memory_dir: str | None, disk_dir: str, memory_bytes: int, disk_bytes: int,
                 check_every: int = 1000) -> None:
        self._dirs = {"memory": memory_dir, "disk": disk_dir}
        self._budget = {"memory": memory_bytes, "disk": disk_bytes}
        self._written = {"memory": 0, "disk": 0}  # by this process since it last added a tier up
        self.check_every = check_every
        self._hits: dict[bytes, int] = {}
        self._drawing: set[bytes] = set()  # datasets found drawing at random: refused
        self.hits = self.misses = self.checked = 0
        for path in self._dirs.values():
            if path:
                os.makedirs(path, exist_ok=True)

    def sample(self, kind: str, digest: bytes, index: int, make: Callable[[], Any]) -> Any:
        """Sample ``index`` of the dataset ``digest``: kept, or ``make()`` and keep it."""
        from dpex import seeding
        from dpex.wire import decode, encode_parts
        name = f"{digest.hex()}-{index}"
        marker = os.path.join(self._dirs["disk"], f".{digest.hex()}.draws")
        if digest in self._drawing or os.path.exists(marker):
            self._drawing.add(digest)
            raise DpexConfigError(_DRAWS.format(index=index, how="this dataset was found drawing at random"))
        data = self._read(name)
        if data is None:
            self.misses += 1
            marks = seeding.draw_marks()
            sample = make()
            if seeding.drew_since(marks):
                self._drawing.add(digest)
                open(marker, "wb").close()  # every process of this worker refuses the dataset from now on
                raise DpexConfigError(_DRAWS.format(index=index, how="it drew at random while it was made"))
            self._write(kind, name, encode_parts(sample))
            return sample
        self.hits += 1
        seen = self._hits[digest] = self._hits.get(digest, 0) + 1
        if seen <= FIRST_CHECKS or seen % self.check_every == 0:
            self.checked += 1
            fresh = b"".join(bytes(p) for p in encode_parts(make()))
            if fresh != bytes(data):
                raise DpexConfigError(
                    f"cache: dataset[{index}] is not what it was when it was cached (its bytes differ): a "
                    "dataset whose samples change between epochs, e.g. with random draws in __getitem__, "
                    "cannot be cached; move the random part to collate_fn, or leave cache unset")
        return decode(data)

    def _read(self, name: str) -> bytearray | None:
        for tier in ("memory", "disk"):
            directory = self._dirs[tier]
            if not directory:
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    data = bytearray(size)
                    if f.readinto(data) != size:
                        continue  # being replaced: as a miss
                os.utime(path)  # recently used: evicted last
                return data
            except OSError:
                continue
        return None

    def _write(self, kind: str, name: str, parts: list) -> None:
        tier = "memory" if kind == "memory" and self._dirs["memory"] else "disk"
        directory = self._dirs[tier]
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self._budget[tier]:
            return
        tmp = os.path.join(directory, f".{name}.{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
            os.replace(tmp, os.path.join(directory, name))
        except OSError:  # full (a container's small /dev/shm): not kept
            _unlink(tmp)
            return
        self._written[tier] += size
        if self._written[tier] >= self._budget[tier] * _SCAN_EVERY:
            self._written[tier] = 0
            self._bound(tier)

    def _bound(self, tier: str) -> None:
        """Brings the tier within its budget: the memory tier's oldest samples
        spill to the disk tier, the disk tier's oldest go."""
        directory, budget = self._dirs[tier], self._budget[tier]
        try:
            entries = [e for e in os.scandir(directory) if not e.name.startswith(".")]
            stats = [(e.stat().st_mtime, e.stat().st_size, e.name) for e in entries]
        except OSError:
            return
        total = sum(size for _, size, _ in stats)
        if total <= budget:
            return
        for _, size, name in sorted(stats):
            if total <= budget * 0.9:
                break
            path = os.path.join(directory, name)
            if tier == "memory":
                try:
                    shutil.move(path, os.path.join(self._dirs["disk"], name))  # another file system: a copy
                except OSError:
                    _unlink(path)
                self._written["disk"] += size
            else:
                _unlink(path)
            total -= size
        if tier == "memory" and self._written["disk"] >= self._budget["disk"] * _SCAN_EVERY:
            self._written["disk"] = 0
            self._bound("disk")


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def tiers_bytes(directories: tuple[str, ...]) -> int:
    """The bytes of the samples kept in these tiers (a worker's load)."""
    total = 0
    for directory in directories:
        try:
            total += sum(e.stat().st_size for e in os.scandir(directory) if not e.name.startswith("."))
        except OSError:  # no such tier yet, or a file just evicted
            continue
    return total
