"""A daemon forked by the warm starter (LocalCluster(warm_start=True)) runs as
the same daemon started as a new interpreter would: a fresh interpreter is the
oracle."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dpex.daemon import spawn
from dpex.launch import warmstart
from dpex.procutil import PARENT_ENV
from dpex.testing import descendants, pids_alive, test_cluster, wait_until

PROBE = textwrap.dedent("""
    import json, multiprocessing, os, signal, sys, tempfile
    import numpy, torch
    out, code = sys.argv[1], int(sys.argv[2])
    with open(out, "w") as f:
        json.dump({
            "name": __name__, "argv": sys.argv[2:3], "cwd": os.getcwd(), "path0": sys.path[0],
            "pythonpath": os.environ["PYTHONPATH"] in sys.path, "probe_env": os.environ.get("PROBE"),
            "tmp": tempfile.gettempdir(), "parent_is_ppid": os.environ.get("DPEX_PARENT_PID") == str(os.getppid()),
            "own_session": os.getsid(0) == os.getpid(),
            "signals": {int(s): str(signal.getsignal(s)) for s in signal.valid_signals()
                        if s not in (signal.SIGKILL, signal.SIGSTOP)},
            "stdin": os.read(0, 10).decode(),
            # what must differ between two daemons, as between two interpreters:
            "torch": torch.initial_seed(), "numpy": int(numpy.random.randint(2**31)), "authkey": multiprocessing.current_process().authkey.hex(),
        }, f)
    print("logged", flush=True)
    sys.exit(code)
""")
RANDOM = ("torch", "numpy", "authkey")


@pytest.fixture
def probe(tmp_path):
    where = tmp_path / "mods"
    where.mkdir()
    (where / "dpexprobe.py").write_text(PROBE)  # written after the starter started: found all the same
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "PYTHONPATH": str(where), "PROBE": "seen", "TMPDIR": str(tmp_path / "tmp"),
            PARENT_ENV: str(os.getpid())}


def run(how, env, tmp_path, name, code=0, session=False):
    out, log = tmp_path / f"{name}.json", str(tmp_path / f"{name}.log")
    if how == "warm":
        process = warmstart.starter().start("dpexprobe", [str(out), str(code)], env, log, session=session)
    else:  # as LocalCluster spawns: python -m MODULE ARGS --ready-file F
        process = spawn(["dpexprobe", str(out), str(code)], str(tmp_path / "ready"), log, env,
                        start_new_session=session)
    assert process.wait(60) == code
    with open(log) as f:
        assert f.read().endswith("logged\n")
    return json.loads(out.read_text())


@pytest.fixture(params=["at a terminal", "in the background"])
def starters_signals(request):
    """SIGINT and SIGHUP as the process that starts the daemons has them: handled, or ignored (a shell's
    background job ignores SIGINT, nohup SIGHUP: the processes it starts inherit that)."""
    ignored = request.param == "in the background"
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.SIG_IGN if ignored else signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN if ignored else signal.SIG_DFL)
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("session", [False, True])
def test_a_warm_started_module_sees_what_a_new_interpreter_sees(probe, tmp_path, session, starters_signals):
    spawned = run("spawn", probe, tmp_path, "spawned", 3, session)
    warm = run("warm", probe, tmp_path, "warm", 3, session)
    again = run("warm", probe, tmp_path, "again", 3, session)
    assert spawned["probe_env"] == "seen" and spawned["tmp"] == str(tmp_path / "tmp") and spawned["parent_is_ppid"]
    assert {k: v for k, v in warm.items() if k not in RANDOM} == {k: v for k, v in spawned.items() if k not in RANDOM}
    for key in RANDOM:
        assert len({spawned[key], warm[key], again[key]}) == 3, key


def test_a_warm_started_process_is_waited_for_and_signalled_as_a_popen(probe, tmp_path):
    (tmp_path / "mods" / "dpexsleeper.py").write_text("import time\nwhile True: time.sleep(1)\n")
    process = warmstart.starter().start("dpexsleeper", [], probe, str(tmp_path / "s.log"))
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.2)
    process.kill()
    assert process.wait(30) == -signal.SIGKILL
    process.kill()  # gone: nothing happens
    assert process.poll() == -signal.SIGKILL


def test_a_warm_process_that_ended_unseen_is_signalled_as_popen_does(probe, tmp_path):
    # The starter reaps a child at once; its report may come after a close() signals it (found by a suite run:
    # ProcessLookupError from a cluster's close). Popen ignores a process gone before it learnt so; so does this.
    (tmp_path / "mods" / "dpexquick.py").write_text("import sys\nsys.exit(5)\n")
    starter = warmstart.starter()
    starter.pump = lambda timeout: None  # its report stays unread
    try:
        process = starter.start("dpexquick", [], probe, str(tmp_path / "q.log"))
        wait_until(lambda: not os.path.exists(f"/proc/{process.pid}"), 30, "the child to be reaped")
        assert process.poll() is None
        process.terminate()
        process.kill()
    finally:
        del starter.pump
    assert process.wait(30) == 5


def test_a_module_that_does_not_exist_exits_with_an_error_in_its_log(probe, tmp_path):
    process = warmstart.starter().start("dpex_no_such_module", [], probe, str(tmp_path / "x.log"))
    assert process.wait(30) == 1
    assert "No module named dpex_no_such_module" in (tmp_path / "x.log").read_text()


OWNER = textwrap.dedent("""
    import os
    from dpex.testing import descendants, test_cluster
    cluster = test_cluster(2, warm_start=True)
    print(" ".join(map(str, descendants(os.getpid()))), flush=True)
    input()
""")


def test_a_killed_owner_takes_its_starter_and_warm_daemons_along():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    children = [int(p) for p in owner.stdout.readline().split()]
    assert len(children) >= 1 + 1 + 2 * 2  # the starter, the dispatcher, the workers and their batch processes
    owner.kill()
    owner.wait()
    wait_until(lambda: pids_alive(children) == [], 30, "the starter and its daemons to exit")


def test_a_warm_cluster_stops_every_daemon_and_leaves_the_starter_for_the_next():
    starter = warmstart.starter()
    before = set(descendants(os.getpid()))
    with test_cluster(2, processes=2) as cluster:
        started = [p for p in descendants(os.getpid()) if p not in before]
        assert len(started) == 1 + 2 + 2 * 2
        assert {w.process.pid for w in cluster.workers} <= set(descendants(starter.process.pid))
    assert pids_alive(started) == []
    assert [w.process.returncode for w in cluster.workers] == [0, 0]  # SIGTERM: drained, exit 0
    assert warmstart.starter() is starter and starter.process.poll() is None
