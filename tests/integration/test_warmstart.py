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
import torch
from torch.utils.data import DataLoader

from dpex import DpexDataLoader
from dpex.daemon import spawn
from dpex.launch import warmstart
from dpex.launch.embedded import stop_embedded
from dpex.procutil import PARENT_ENV
from dpex.testing import descendants, netns, pids_alive, programs, test_cluster, wait_until

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
            "stdin": os.read(0, 10).decode(), "threads": torch.get_num_threads(),
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
            PARENT_ENV: str(os.getpid()), "OMP_NUM_THREADS": "1"}  # torch's threads: 1, not the starter's


def run(how, env, tmp_path, name, code=0, session=False):
    out, log = tmp_path / f"{name}.json", str(tmp_path / f"{name}.log")
    if how == "warm":
        process = warmstart.starter().start(["-m", "dpexprobe", str(out), str(code)], env, log, session=session)
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
    process = warmstart.starter().start(["-m", "dpexsleeper"], probe, str(tmp_path / "s.log"))
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
        process = starter.start(["-m", "dpexquick"], probe, str(tmp_path / "q.log"))
        wait_until(lambda: not os.path.exists(f"/proc/{process.pid}"), 30, "the child to be reaped")
        assert process.poll() is None
        process.terminate()
        process.kill()
    finally:
        del starter.pump
    assert process.wait(30) == 5


def test_a_module_that_does_not_exist_exits_with_an_error_in_its_log(probe, tmp_path):
    process = warmstart.starter().start(["-m", "dpex_no_such_module"], probe, str(tmp_path / "x.log"))
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
        assert len(started) == 1 + 2 + 2 * 2 + 2  # the dispatcher, the workers, their batch processes and forkservers
        assert {w.process.pid for w in cluster.workers} <= set(descendants(starter.process.pid))
    assert pids_alive(started) == []
    assert [w.process.returncode for w in cluster.workers] == [0, 0]  # SIGTERM: drained, exit 0
    assert warmstart.starter() is starter and starter.process.poll() is None


def test_an_embedded_cluster_forks_its_daemons_from_the_warm_starter_its_process_has():
    """A process that has a warm starter (a LocalCluster(warm_start=True) started it) forks an embedded
    cluster's dispatcher and spawned worker from it too; the batches are torch's."""
    stop_embedded()  # one a test before left lingering would be reused
    starter = warmstart.starter()
    before = set(descendants(starter.process.pid))
    data = [torch.tensor([float(i)]) for i in range(20)]
    loader = DpexDataLoader(data, distribute_mode=True, batch_size=4, num_workers=1, multiprocessing_context="spawn")
    batches = iter(loader)
    got = [next(batches)]
    forked = set(descendants(starter.process.pid)) - before
    assert len(forked) >= 2  # the dispatcher, the worker (and its batch process)
    got += list(batches)
    assert [b.tolist() for b in got] == [b.tolist() for b in DataLoader(data, batch_size=4)]
    stop_embedded()
    assert pids_alive(sorted(forked)) == []


PROGRAM = textwrap.dedent("""
    import atexit, json, multiprocessing, multiprocessing.process, os, sys, threading, time
    def square(x):
        return x * x
    if __name__ == "__main__":
        report = {"argv": sys.argv, "path0": sys.path[0], "file": globals().get("__file__"), "cwd": os.getcwd(),
                  "spec": getattr(__spec__, "name", None), "original_dir": multiprocessing.process.ORIGINAL_DIR,
                  "probe": os.environ.get("PROBE"), "pythonpath": os.environ["PYTHONPATH"] in sys.path,
                  "stdin": sys.stdin.read()}
        if "spawn" in sys.argv:  # spawn's child imports this program's __main__ again
            with multiprocessing.get_context("spawn").Pool(1) as pool:
                report["spawned"] = pool.map(square, [3])
        print(json.dumps(report), flush=True)
        threading.Thread(target=lambda: (time.sleep(0.2), print("a thread's last words", flush=True))).start()
        atexit.register(print, "at exit")
        if "raise" in sys.argv:
            raise ValueError("from the program")
        sys.exit(int(sys.argv[1]))
""")


@pytest.mark.parametrize("form", ["-c", "script", "-m"])
@pytest.mark.parametrize("how", ["exit 3", "raise", "spawn"])
def test_a_warm_started_program_runs_as_a_new_interpreter_runs_it(probe, tmp_path, form, how):
    """``python -c CODE``, ``python SCRIPT`` and ``python -m MODULE``, each run both ways (dpex.testing.programs,
    and a new interpreter as the oracle): the same sys.argv, sys.path, __main__, output, exit code and traceback."""
    if form == "-c" and how == "spawn":
        pytest.skip("spawn cannot import a -c program's functions (in either)")
    (tmp_path / "prog.py").write_text(PROGRAM)
    argv = {"-c": ["-c", PROGRAM], "script": ["prog.py"], "-m": ["-m", "prog"]}[form] + ["3", *how.split()[:1]]
    new = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=probe, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=120)
    warm = programs.run(argv, cwd=str(tmp_path), env=probe, timeout=120)
    assert warm.returncode == new.returncode == (1 if how == "raise" else 3), (warm.stderr, new.stderr)
    assert warm.stdout == new.stdout
    assert new.stdout.endswith("a thread's last words\nat exit\n")
    if how == "raise":  # the program's frames and the error; no frame of the starter
        assert warm.stderr.splitlines()[-3:] == new.stderr.splitlines()[-3:]
        assert warm.stderr.startswith("Traceback") and "warmstart" not in warm.stderr
    else:
        assert warm.stderr == new.stderr == ""


BUFFERING = "import os, sys\nprint('out')\nos.write(1, b'raw\\n')\nprint('err', file=sys.stderr)\nos.write(2, b'raw\\n')"


@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_warm_started_programs_output_is_buffered_as_a_new_interpreters(probe, tmp_path, unbuffered):
    """Python buffers a program's stdout on a pipe (its print after a raw write; all of it written at exit,
    never lost), not under PYTHONUNBUFFERED, line by line at a terminal; stderr line by line: a new
    interpreter is the oracle, whatever the starter's own buffering."""
    env = {k: v for k, v in probe.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    new = subprocess.run([sys.executable, "-c", BUFFERING], env=env, capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=120)
    warm = programs.run(["-c", BUFFERING], env=env, timeout=120)
    assert (warm.stdout, warm.stderr) == (new.stdout, new.stderr)
    assert new.stdout == ("out\nraw\n" if unbuffered else "raw\nout\n") and new.stderr == "err\nraw\n"
    at_terminal = []
    for start in (lambda fds: subprocess.Popen([sys.executable, "-c", BUFFERING], env=env, stdin=fds[0],
                                               stdout=fds[1], stderr=fds[2]),
                  lambda fds: warmstart.starter(programs.TRAINER).start(["-c", BUFFERING], env, fds)):
        leader, terminal = os.openpty()
        try:
            with open(os.devnull, "rb") as null:
                process = start((null.fileno(), terminal, terminal))
            os.close(terminal)
            assert process.wait(60) == 0
            out = b""
            while True:
                try:
                    chunk = os.read(leader, 1024)
                except OSError:  # EIO: the terminal's last end closed, all read
                    break
                if not chunk:
                    break
                out += chunk
            at_terminal.append(out)
        finally:
            os.close(leader)
    assert at_terminal[0] == at_terminal[1] == b"out\r\nraw\r\nerr\r\nraw\r\n"


def test_a_warm_started_programs_pipes_are_popens(probe, tmp_path):
    program = programs.popen(["-c", "import sys\nfor line in sys.stdin: print(line.upper(), end='', flush=True)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=probe)
    program.stdin.write("hello\n")
    program.stdin.flush()  # buffered, as Popen's
    assert program.stdout.readline() == "HELLO\n"
    program.stdin.close()
    assert program.wait(60) == 0 and program.stdout.read() == ""
    program.stdout.close()
    with pytest.raises(subprocess.TimeoutExpired):  # killed at its timeout, as subprocess.run's
        programs.run(["-c", "import time\nwhile True: time.sleep(1)"], env=probe, timeout=0.5)


@pytest.mark.skipif(not netns.available(), reason="needs root and ip netns")
def test_a_warm_started_program_in_a_network_namespace_sees_what_ip_netns_exec_shows_it():
    code = "import socket; print(sorted(name for _, name in socket.if_nameindex()))"
    with netns.NetnsCluster(workers=0, dispatcher=False) as hosts:
        new = subprocess.run(["ip", "netns", "exec", hosts.ns("trainer"), sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=120)
        warm = programs.run(["-c", code], netns=hosts.ns("trainer"), timeout=120)
        assert warm.returncode == new.returncode == 0, (warm.stderr, new.stderr)
        assert warm.stdout == new.stdout and "lo" in warm.stdout
        assert warm.stdout != programs.run(["-c", code], timeout=120).stdout  # not this host's interfaces
    gone = programs.run(["-c", code], netns=hosts.ns("trainer"), timeout=120)  # deleted with the hosts
    assert gone.returncode == 1 and "No such file or directory" in gone.stderr
