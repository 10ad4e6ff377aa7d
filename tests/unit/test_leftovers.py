"""The suite's leftover check (tests/conftest.py) names what the suite left,
not what a process it did not start holds: a user's dpex-worker running
beside the tests, or another run (issue 58)."""
import os
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
