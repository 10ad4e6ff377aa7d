"""What the whole suite checks once: it leaves nothing behind.

The check runs in the process that runs the session: pytest itself, or
pytest-xdist's controller once every worker process is done (a worker
process would see the other's live directories)."""
import gc
import os
import sys
import tempfile
import time

import pytest

from dpex import procutil, shm
from dpex.testing import wait_until

_BEFORE = pytest.StashKey[set]()
_LEFT = pytest.StashKey[list]()


def leftovers() -> set[str]:
    """Dpex's directories in the temp directory and /dev/shm, and the named
    semaphores of multiprocessing there (a worker's batch pool makes some)."""
    found = set()
    for root, prefixes in ((tempfile.gettempdir(), ("dpex-",)), ("/dev/shm", ("dpex-", "sem.mp-"))):
        if os.path.isdir(root):
            found |= {os.path.join(root, e) for e in os.listdir(root) if e.startswith(prefixes)}
    return found


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_xdist_worker(session.config):
        session.config.stash[_BEFORE] = leftovers()


@pytest.fixture(scope="session", autouse=True)
def collect_garbage_last():
    yield
    # The oracle tests' torch DataLoaders (their workers) hold named semaphores
    # in iterators that an exception's frames keep in a cycle: let them go.
    gc.collect()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _is_xdist_worker(session.config) or _BEFORE not in session.config.stash:
        return
    before = session.config.stash[_BEFORE]

    def left() -> set[str]:
        # A directory whose owner a test killed is not a leak: the next Dpex process
        # removes it (test_lifecycle holds it to that). Do so now; what stays is one.
        for kind in ("worker", "dispatcher", "cluster", "ray"):
            procutil.remove_dead_temp_dirs(kind)
        shm.remove_dead_dirs()
        return leftovers() - before

    # Daemons stopped by the last tests may still be exiting: wait, then name what stayed.
    try:
        wait_until(lambda: not left(), 20, "dpex directories to be removed")
    except TimeoutError:
        session.config.stash[_LEFT] = sorted(left())
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _describe(path: str) -> str:
    """A leftover, with what it holds: which test left it is then findable."""
    try:
        entries = sorted(os.listdir(path)) if os.path.isdir(path) else []
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return f"{path} (gone since)"
    return f"{path} (modified {age:.0f} s before the end; holds {entries[:12]})"


def pytest_unconfigure(config: pytest.Config) -> None:
    # Last of all, after pytest's own summary: a CI that keeps only the tail of
    # the output still shows what was left.
    if _LEFT in config.stash:
        lines = "\n".join(f"  {_describe(p)}" for p in config.stash[_LEFT])
        print(f"\nFAILED: the tests left behind:\n{lines}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module", autouse=True)
def no_embedded_cluster_outlives_its_module():
    """An embedded cluster waits 10 s for the process's next loader: none is
    left running (and loading the machine) under the next module's tests."""
    yield
    from dpex.launch import local
    local.stop_embedded()
