"""What the whole suite checks once: it leaves nothing behind."""
import gc
import os
import tempfile

import pytest

from dpex.testing import wait_until


def leftovers() -> set[str]:
    """Dpex's directories in the temp directory and /dev/shm, and the named
    semaphores of multiprocessing there (a worker's batch pool makes some)."""
    found = set()
    for root, prefixes in ((tempfile.gettempdir(), ("dpex-",)), ("/dev/shm", ("dpex-", "sem.mp-"))):
        if os.path.isdir(root):
            found |= {os.path.join(root, e) for e in os.listdir(root) if e.startswith(prefixes)}
    return found


@pytest.fixture(scope="session", autouse=True)
def nothing_left_behind():
    before = leftovers()
    yield
    # Daemons stopped by the last tests may still be exiting: wait, then name what stayed.
    # Garbage of this process goes first: the oracle tests' torch DataLoaders (spawned
    # workers) hold named semaphores in iterators that an exception's frames keep in a cycle.
    gc.collect()
    try:
        wait_until(lambda: not (leftovers() - before), 20, "dpex directories to be removed")
    except TimeoutError:
        pytest.fail(f"the tests left behind: {sorted(leftovers() - before)}")


@pytest.fixture(scope="module", autouse=True)
def no_embedded_cluster_outlives_its_module():
    """An embedded cluster waits 10 s for the process's next loader: none is
    left running (and loading the machine) under the next module's tests."""
    yield
    from dpex.launch import local
    local.stop_embedded()

