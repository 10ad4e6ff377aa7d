"""dpex.stdlib against the running Python: each private field Dpex reaches
into still means what Dpex needs, or this fails (not a user's job)."""
import multiprocessing
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ProcessPoolExecutor

from dpex import stdlib
from dpex.procutil import alive
from dpex.testing import wait_until


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_an_executors_processes_start_at_once_and_are_listed_until_shut_down():
    executor = ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"))
    try:
        assert stdlib.executor_processes(executor) == []
        stdlib.start_executor_processes(executor)
        processes = stdlib.executor_processes(executor)
        assert len(processes) == 2 and all(isinstance(p, multiprocessing.process.BaseProcess) for p in processes)
        assert executor.submit(os.getpid).result(timeout=60) in {p.pid for p in processes}
    finally:
        executor.shutdown(wait=True)
    assert stdlib.executor_processes(executor) == []


def test_multiprocessings_temp_dir_is_the_one_set(tmp_path):
    result = run(f"""
        import multiprocessing.util
        from dpex import stdlib
        stdlib.set_multiprocessing_tempdir({str(tmp_path)!r})
        print(multiprocessing.util.get_temp_dir())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path)


def test_a_forked_child_that_forgets_its_parents_forkserver_starts_its_own():
    result = run("""
        import multiprocessing, multiprocessing.forkserver as fs, os, sys
        from dpex import stdlib
        if __name__ == "__main__":
            context = multiprocessing.get_context("forkserver")
            p = context.Process(target=os.getpid); p.start(); p.join()
            parents = fs._forkserver._forkserver_pid
            child = os.fork()
            if child == 0:
                stdlib.forget_forkserver()
                p = context.Process(target=os.getpid); p.start(); p.join(60)
                mine = fs._forkserver._forkserver_pid
                os._exit(0 if p.exitcode == 0 and mine not in (None, parents) else 3)
            _, status = os.waitpid(child, 0)
            sys.exit(os.waitstatus_to_exitcode(status))
    """)
    assert result.returncode == 0, result.stderr


def test_a_forked_child_finishes_as_the_interpreter_does():
    # A child that ends with os._exit after finish_interpreter(): its threads are waited for, then its exit
    # handlers run, as at a new interpreter's exit (without it, neither happens).
    result = run("""
        import atexit, os, threading, time
        from dpex import stdlib
        r, w = os.pipe()
        child = os.fork()
        if child == 0:
            threading.Thread(target=lambda: (time.sleep(0.2), os.write(w, b"thread,"))).start()
            atexit.register(lambda: os.write(w, b"atexit"))
            stdlib.finish_interpreter()
            os._exit(0)
        os.close(w)
        os.waitpid(child, 0)
        print(os.read(r, 100).decode() + os.read(r, 100).decode())
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "thread,atexit"


def test_a_forkserver_forked_from_this_process_serves_its_children_and_holds_none_of_its_files(tmp_path):
    result = run(f"""
        import multiprocessing, multiprocessing.forkserver as fs, os, sys
        from dpex import stdlib
        if __name__ == "__main__":
            held = open({str(tmp_path / "held")!r}, "w")
            stdlib.fork_forkserver()
            server = fs._forkserver._forkserver_pid
            assert os.waitpid(server, os.WNOHANG) == (0, 0)  # our child, alive
            cmdline = lambda pid: open(f"/proc/{{pid}}/cmdline").read()
            assert cmdline(server) == cmdline(os.getpid())  # a fork of this process, not a new interpreter
            context = multiprocessing.get_context("forkserver")
            p = context.Process(target=os.getpid)
            p.start()
            p.join(60)
            assert p.exitcode == 0 and fs._forkserver._forkserver_pid == server  # that server, not a new one
            fds = []
            for fd in os.listdir(f"/proc/{{server}}/fd"):
                try:
                    fds.append(os.readlink(f"/proc/{{server}}/fd/{{fd}}"))
                except FileNotFoundError:  # closed since the listing (the server is still at its child's end)
                    pass
            assert held.name not in fds, fds
            print(server)
    """)
    assert result.returncode == 0, result.stderr
    server = int(result.stdout)
    wait_until(lambda: not alive(server), 30, "the forkserver to end with its process")
