"""Large frames go from a batch process to its daemon through a file in
/dev/shm: one copy in, one copy out, instead of the pool's pickled pipe
(join, pickle, pipe write, pipe read, unpickle). Small frames, and any
frame when /dev/shm is missing or full, take the pipe.

A trainer on the same host (same boot, same /dev/shm) gets only the file's
name and maps the file itself: no copy at all between batch process and
trainer, and no gRPC for the bytes.

Files are reused: tmpfs allocating and freeing every page of every frame was
half the cost of a hand-off on the worker, and a third of a same-host
trainer's CPU. A file the daemon has read (to send its bytes over gRPC)
becomes a spare (``.spare-*``) at once. A file a trainer maps is renamed
``.lent-<trainer pid>-*`` and becomes a spare only when the trainer's mapping
is gone (its batch was freed), so a mapped page is never overwritten; lent
files of trainers that died are removed by the worker. Batch processes write
each frame over a spare's pages when there is one, keeping at most one spare
per process.

The worker, the client and the launcher share this protocol: it lives here,
not in one of its users (the Fetch stream's keys are dpex.wire.pairing's)."""
from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import time
from typing import NamedTuple

from dpex import finalizers, procutil
from dpex.procutil import alive

log = logging.getLogger("dpex.worker")

SHM = "/dev/shm"
MIN_BYTES = 1 << 20  # below this the pipe is as cheap
SPARE = ".spare-"  # a file read and sent, kept for the next frame to overwrite
LENT = ".lent-"    # a file a trainer has mapped: .lent-<trainer pid>-<name>
SPARE_IDLE_S = 10.0  # a spare not taken for this long goes (sweep_spares): an idle worker holds no spare memory


class Handoff(NamedTuple):
    path: str
    size: int
    meta: bytes = b""  # the frame's serialized Batch metadata (no payload)
    offset: int = 0    # where the frame starts in the file (one written in place: dpex.worker.slabs)


def host_id() -> str:
    """Same value in two processes: they share a boot and a /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM)
    except OSError:
        return ""
    return f"{boot}:{st.st_dev}:{st.st_ino}"


def size_of(frame: "bytes | Handoff") -> int:
    return frame.size if isinstance(frame, Handoff) else len(frame)


def discard(item: "bytes | Handoff") -> None:
    """Drops a frame nobody will take (released, cancelled, a duplicate)."""
    if isinstance(item, Handoff):
        try:
            os.unlink(item.path)
        except OSError:  # gone, or not ours to remove
            pass


def _daemon_pid(directory_name: str) -> str | None:
    """The pid in a hand-off directory's name ``dpex-<pid>``, else None."""
    pid = directory_name.removeprefix("dpex-")
    return pid if directory_name.startswith("dpex-") and pid.isdigit() else None


def is_handoff_path(path: str) -> bool:
    """Only files in a dpex hand-off directory are ever mapped or removed."""
    directory, name = os.path.split(path)
    parent, leaf = os.path.split(directory)
    return (os.path.normpath(path) == path and parent == SHM and _daemon_pid(leaf) is not None
            and bool(name) and not name.startswith("."))


def map_frame(path: str, size: int, offset: int = 0) -> memoryview:
    """A same-host trainer's view of the frame in a hand-off file (``size``
    bytes from ``offset``): mapped (private, so the tensors are writable
    without touching the file) and lent: the file goes back to the worker as
    a spare once the mapping is gone."""
    if not is_handoff_path(path):
        raise OSError(f"not a dpex hand-off file: {path!r}")
    fd = os.open(path, os.O_RDONLY)
    try:
        actual = os.fstat(fd).st_size
        if actual < offset + size or size == 0:
            _unlink(path)
            raise OSError(f"hand-off file {path} is {actual} bytes, expected {size} from {offset}")
        mapped = mmap.mmap(fd, offset + size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    directory, name = os.path.split(path)
    lent = os.path.join(directory, f"{LENT}{os.getpid()}-{name}")
    try:
        os.rename(path, lent)
    except OSError:  # the worker removed it meanwhile: the mapping holds the data
        return memoryview(mapped)[offset:]
    # Runs once the mapping is unmapped, i.e. when the batch's last tensor dies.
    finalizers.finalize(mapped, _give_back, lent, os.path.join(directory, SPARE + name), _forks, at_exit=False)
    return memoryview(mapped)[offset:]


_forks = 0  # a child forked while a file was mapped maps it too: that file is not given back


def _count_fork() -> None:
    global _forks
    _forks += 1


os.register_at_fork(before=_count_fork)


def _give_back(lent: str, spare: str, forks: int) -> None:
    try:
        if forks == _forks:
            os.rename(lent, spare)
        else:
            os.unlink(lent)
    except OSError:  # the worker exited or removed it: nothing to give back
        pass


def sweep_lent(directory: str | None) -> None:
    """Removes files lent to trainers that are gone (they never give them
    back). Removing one still mapped would be harmless: the mapping stays."""
    if not directory:
        return
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        pid = name.removeprefix(LENT).split("-", 1)[0]
        if name.startswith(LENT) and pid.isdigit() and not alive(int(pid)):
            _unlink(os.path.join(directory, name))


FULL = ".full"  # made by the first process of a worker to find /dev/shm full: it says so, once


def too_small(directory: str, nbytes: int, error: OSError) -> None:
    """A hand-off file of ``nbytes`` could not be had (``error``): the batch
    goes through the pipe. A full /dev/shm is said once per worker (the first
    of its processes to meet it makes the FULL mark)."""
    if error.errno not in (errno.ENOSPC, errno.ENOMEM):
        return
    try:
        os.close(os.open(os.path.join(directory, FULL), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        return  # said already (or the mark cannot be made either: the next one says it)
    try:
        fs = os.statvfs(directory)
        room = f"{fs.f_bavail * fs.f_frsize / 2**20:.0f} MB free of {fs.f_blocks * fs.f_frsize / 2**20:.0f} MB"
    except OSError:
        room = "its size unknown"
    log.warning("%s is too small for the batches: one of %.1f MB did not fit (%s); batches that do not fit go "
                "through the pipe instead, a copy more each. Give the worker a larger /dev/shm (docker run "
                "--shm-size, compose's shm_size, a Kubernetes emptyDir of medium Memory)",
                os.path.dirname(directory) or directory, nbytes / 2**20, room)


def sweep_spares(directory: str | None, idle_s: float = SPARE_IDLE_S) -> int:
    """Removes the spares nobody took for ``idle_s`` (a spare's rename to its
    name sets its ctime): a worker gone idle gives their memory back, once
    the batch processes that keep them mapped let go (dpex.worker.slabs).
    Returns how many went."""
    if not directory:
        return 0
    try:
        entries = [e for e in os.scandir(directory) if e.name.startswith(SPARE)]
    except OSError:
        return 0
    now, removed = time.time(), 0
    for entry in entries:
        try:
            if now - entry.stat().st_ctime > idle_s:
                os.unlink(entry.path)
                removed += 1
        except OSError:  # taken meanwhile
            pass
    return removed


def usage(directory: str | None) -> dict[str, int]:
    """Bytes in the hand-off directory: frames (produced, not yet sent or
    mapped), lent (mapped by trainers) and spare."""
    used = {"frame": 0, "lent": 0, "spare": 0}
    try:
        entries = list(os.scandir(directory)) if directory else []
    except OSError:
        return used
    for entry in entries:
        if entry.is_dir():  # the sample cache's memory tier (dpex.worker.samples), not frames
            continue
        kind = "spare" if entry.name.startswith(SPARE) else "lent" if entry.name.startswith(LENT) else "frame"
        try:
            used[kind] += entry.stat().st_size
        except OSError:  # taken meanwhile
            pass
    return used


def remove_dead_dirs() -> None:
    """Removes the hand-off directories of daemons that are gone (killed
    before they could remove their own)."""
    procutil.remove_dead_dirs(SHM, r"dpex-(\d+)")


def make_dir() -> str | None:
    """This daemon's hand-off directory (and removes those of dead daemons)."""
    if not os.path.isdir(SHM) or not os.access(SHM, os.W_OK):
        return None
    remove_dead_dirs()
    path = os.path.join(SHM, f"dpex-{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def remove_dir(path: str | None) -> None:
    """Removes the directory, again if a file was renamed into it meanwhile
    (a trainer giving a batch back while this daemon exits)."""
    for _ in range(3):
        if not path or not os.path.exists(path):
            return
        shutil.rmtree(path, ignore_errors=True)


def write(directory: str, name: str, parts: list, meta: bytes = b"", keep_spares: int = 1) -> Handoff | None:
    """Writes the frame's parts to a file (over a spare's pages when there is
    one, removing spares beyond ``keep_spares``); None if it cannot (the pipe
    it is)."""
    path = os.path.join(directory, name)
    fd = claim_spare(directory, path, keep_spares)
    reused = fd is not None
    try:
        if fd is None:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return None
    size = 0
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                written = os.write(fd, view)
                size += written
                view = view[written:]
        if reused:
            os.ftruncate(fd, size)  # a bigger spare's tail goes
    except OSError as e:  # e.g. ENOSPC: a container's small /dev/shm
        os.close(fd)
        os.unlink(path)
        too_small(directory, sum(memoryview(p).nbytes for p in parts), e)
        return None
    os.close(fd)
    return Handoff(path, size, meta)


def frame(directory: str | None, min_bytes: int, name: str, parts: list, keep_spares: int = 1) -> "bytes | Handoff":
    """A frame of ``parts`` (its serialized Batch header first): a hand-off
    file named ``name`` in ``directory`` when it has ``min_bytes`` or more
    and the file can be written, else the bytes."""
    if directory and sum(memoryview(p).nbytes for p in parts) >= min_bytes:
        sent = write(directory, name, parts, parts[0], keep_spares)
        if sent is not None:
            return sent
    return b"".join(parts)


def claim_spare(directory: str, path: str, keep: int, prefer: str = "", flags: int = os.O_WRONLY) -> int | None:
    """Renames a spare file to ``path`` and opens it (``flags``), if any: one
    whose name starts with ``SPARE + prefer`` first (a batch process's own,
    which it may still have mapped). Removes the spares beyond ``keep``, the
    others first: more than are needed (trainers gave back a window's worth)."""
    try:
        spares = [n for n in os.listdir(directory) if n.startswith(SPARE)]
    except OSError:
        return None
    if prefer:
        spares.sort(key=lambda n: not n.startswith(SPARE + prefer))
    for i, spare in enumerate(spares):
        try:
            os.rename(os.path.join(directory, spare), path)
        except OSError:
            continue  # another process took it first
        for extra in spares[i + 1:][keep:][::-1]:
            _unlink(os.path.join(directory, extra))
        try:
            return os.open(path, flags)
        except OSError:
            _unlink(path)
            return None
    return None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def take(handoff: Handoff, spares: int = 0) -> bytes:
    """The frame's bytes. The file is gone afterwards: kept as a spare while
    fewer than ``spares`` exist, else removed."""
    try:
        data = read(handoff)
    finally:
        _recycle(handoff.path, spares)
    if len(data) != handoff.size:
        raise OSError(f"hand-off file {handoff.path} is {len(data)} bytes, expected {handoff.size}")
    return data


def read(handoff: Handoff) -> bytes:
    """The frame's bytes, copied out of its file (which stays)."""
    fd = os.open(handoff.path, os.O_RDONLY)
    try:
        return os.pread(fd, handoff.size, handoff.offset)
    finally:
        os.close(fd)


def _recycle(path: str, spares: int) -> None:
    directory, name = os.path.split(path)
    try:
        if spares and sum(n.startswith(SPARE) for n in os.listdir(directory)) < spares:
            os.rename(path, os.path.join(directory, SPARE + name))
            return
    except OSError:
        pass
    _unlink(path)
