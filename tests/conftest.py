"""What the whole suite checks once: it leaves nothing behind.

The check runs in the process that runs the session: pytest itself, or
pytest-xdist's controller once every worker process is done (a worker
process would see the other's live directories).

Each process that runs tests starts its warm starter first (dpex.launch.warmstart):
its test clusters and its tests' embedded clusters fork their daemons from it."""
import gc
import os
import sys
import tempfile
import time

import pytest

from dpex import procutil, shm
from dpex.launch import warmstart
from dpex.testing import wait_until

_BEFORE = pytest.StashKey[set]()
_LEFT = pytest.StashKey[list]()


_SESSION_ENV = "DPEX_TEST_SESSION"  # in every process the suite starts: what is not theirs is not its leftover


def leftovers() -> set[str]:
    """Dpex's directories in the temp directory and /dev/shm, and the named
    semaphores of multiprocessing there (a worker's batch pool makes some)."""
    found = set()
    for root, prefixes in ((tempfile.gettempdir(), ("dpex-",)), ("/dev/shm", ("dpex-", "sem.mp-"))):
        if os.path.isdir(root):
            found |= {os.path.join(root, e) for e in os.listdir(root) if e.startswith(prefixes)}
    return found


def _of_this_suite(pid: int, session: str) -> bool | None:
    """Whether a live process was started by this suite (None: it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{_SESSION_ENV}={session}".encode() in f.read().split(b"\0")
    except FileNotFoundError:
        return None
    except OSError:  # another user's: not ours
        return False


def _others(paths: set[str], session: str) -> set[str]:
    """Those of ``paths`` that a live process the suite did not start owns
    (its pid in the name) or maps (a named semaphore): a user's own
    dpex-worker, or another run beside the suite, is not a leak of the suite's."""
    owners: dict[str, set[int]] = {}
    for path in paths:
        pid = procutil.owner_pid(os.path.basename(path))
        if pid is not None:
            owners[path] = {pid}
    semaphores = {p for p in paths if os.path.basename(p).startswith("sem.")}
    if semaphores:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped = {line.split(None, 5)[-1].strip() for line in f if "/dev/shm/sem." in line}
            except OSError:
                continue
            for path in semaphores & mapped:
                owners.setdefault(path, set()).add(int(pid))
    return {path for path, pids in owners.items()
            if pids and all(_of_this_suite(pid, session) is False for pid in pids)}


def _is_xdist_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if not _is_xdist_worker(config):  # before xdist starts its workers, which inherit it
        os.environ[_SESSION_ENV] = f"{os.getpid()}-{time.time_ns()}"


# Files that mostly wait (a Ray cluster scaling, the differential tester's programs, the chaos runs' heartbeats
# and timeouts), each of one or two tests: xdist (`--dist loadfile`) starts files with more tests first, so these
# came last and ran alone on a machine otherwise idle. The Makefile turns xdist's reordering off; here they go
# first, one in every other place, so that each process gets one beside a file that keeps the CPU busy.
WAIT_FIRST = ("tests/multinode/test_ray_autoscale.py", "tests/integration/test_programs_1.py",
              "tests/integration/test_chaos.py", "tests/integration/test_programs_2.py",
              "tests/integration/test_programs_3.py", "tests/multinode/test_chaos.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if getattr(config.option, "loadscopereorder", True):  # xdist orders the files itself
        return
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    waits = [name for name in WAIT_FIRST if name in files]
    rest = sorted((name for name in files if name not in waits), key=lambda name: -len(files[name]))  # as xdist
    order = [name for pair in zip(waits, rest) for name in pair] + rest[len(waits):] + waits[len(rest):]
    items[:] = [item for name in order for item in files[name]]


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_xdist_worker(session.config):
        session.config.stash[_BEFORE] = leftovers()
    runs_tests = _is_xdist_worker(session.config) or not getattr(session.config.option, "numprocesses", None)
    if runs_tests and warmstart.available():
        warmstart.starter()


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
        for kind in ("worker", "dispatcher", "cluster", "ray", "chaos"):
            procutil.remove_dead_temp_dirs(kind)
        shm.remove_dead_dirs()
        new = leftovers() - before
        return new - _others(new, os.environ[_SESSION_ENV])

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
    from dpex.launch import embedded
    embedded.stop_embedded()
