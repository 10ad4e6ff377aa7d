"""Large frames go from a batch process to its daemon through a file in
/dev/shm: one copy in, one copy out, instead of the pool's pickled pipe
(join, pickle, pipe write, pipe read, unpickle). Small frames, and any
frame when /dev/shm is missing or full, take the pipe."""
from __future__ import annotations

import os
import shutil
from typing import NamedTuple

SHM = "/dev/shm"
MIN_BYTES = 1 << 20  # below this the pipe is as cheap


class Handoff(NamedTuple):
    path: str
    size: int


def make_dir() -> str | None:
    """This daemon's hand-off directory (and removes those of dead daemons)."""
    if not os.path.isdir(SHM) or not os.access(SHM, os.W_OK):
        return None
    for entry in os.listdir(SHM):
        if entry.startswith("dpex-") and entry[5:].isdigit() and not os.path.exists(f"/proc/{entry[5:]}"):
            shutil.rmtree(os.path.join(SHM, entry), ignore_errors=True)
    path = os.path.join(SHM, f"dpex-{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def remove_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def write(directory: str, name: str, parts: list) -> Handoff | None:
    """Writes the frame's parts to a file; None if it cannot (the pipe it is)."""
    path = os.path.join(directory, name)
    try:
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
    except OSError:  # e.g. ENOSPC: a container's small /dev/shm
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return Handoff(path, size)


def take(handoff: Handoff) -> bytes:
    """The frame's bytes; the file is gone afterwards."""
    try:
        with open(handoff.path, "rb", buffering=0) as f:
            data = f.read(handoff.size)
    finally:
        os.unlink(handoff.path)
    if len(data) != handoff.size:
        raise OSError(f"hand-off file {handoff.path} is {len(data)} bytes, expected {handoff.size}")
    return data
