"""dpex.finalizers: a finalizer or exit hook runs in the process that made it, never in a forked child."""
import os
import subprocess
import sys
import textwrap

from dpex import finalizers


class _Held:
    pass


def test_a_finalizer_runs_in_its_process_and_not_in_a_forked_childs():
    ran: list = []
    held = _Held()
    finalizer = finalizers.finalize(held, lambda *args: ran.append((os.getpid(),) + args) or "result", 1, 2)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child collects its copy, and its finalizer is called outright
        try:
            del held
            finalizer()
            os.write(write, repr(ran).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 100) == b"[]"
    assert finalizer.alive and finalizer() == "result" and ran == [(os.getpid(), 1, 2)]
    assert not finalizer.alive and finalizer() is None


def test_an_exit_hook_runs_at_its_process_exit_and_not_at_a_forked_childs():
    script = textwrap.dedent("""
        import os, sys
        from dpex import finalizers
        finalizers.register_at_exit(lambda: print("exit", "parent" if os.getpid() == parent else "child", flush=True))
        parent = os.getpid()
        if os.fork() == 0:
            sys.exit(0)  # a normal exit: atexit's hooks run
        os.wait()
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "exit parent\n"
