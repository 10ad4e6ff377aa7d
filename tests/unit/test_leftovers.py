"""The suite's leftover check (tests/conftest.py) names what the suite left,
not what a process it did not start holds: a user's dpex-worker running
beside the tests, or another run (issue 58)."""
import os
import shutil
import subprocess
import sys

from tests.conftest import _SESSION_ENV, _others


def test_a_directory_of_a_process_the_suite_did_not_start_is_not_its_leftover(tmp_path):
    session = os.environ[_SESSION_ENV]
    foreign_env = {k: v for k, v in os.environ.items() if k != _SESSION_ENV}
    ours = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    theirs = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                              env=foreign_env)
    try:
        paths = {str(tmp_path / f"dpex-{ours.pid}"), str(tmp_path / f"dpex-worker-{theirs.pid}-x1"),
                 str(tmp_path / "dpex-999999999")}  # a dead owner's: the suite's, as before
        assert _others(paths, session) == {str(tmp_path / f"dpex-worker-{theirs.pid}-x1")}
    finally:
        for p in (ours, theirs):
            p.stdin.close()
            p.wait()


def test_a_dpex_directorys_owner_is_read_from_its_name_as_each_kind_names_it():
    from dpex import procutil, shm
    had = os.path.isdir(os.path.join(shm.SHM, f"dpex-{os.getpid()}"))  # a pool of this process's may use it
    made = [shm.make_dir(), procutil.temp_dir("test")]  # /dev/shm/dpex-PID, a temp dpex-KIND-PID-…
    try:
        assert [procutil.owner_pid(os.path.basename(d)) for d in made] == [os.getpid()] * 2
    finally:
        for d in made[had:]:
            shutil.rmtree(d, ignore_errors=True)
    assert [procutil.owner_pid(n) for n in ("dpex-12-", "dpex-x", "dpex-", "sem.mp-1", "dpex-worker-7")] == \
        [None, None, None, None, 7]
