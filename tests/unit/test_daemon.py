"""dpex.daemon, both sides of a daemon's life: spawned with a ready file,
awaited, serving until SIGTERM, stopped (SIGKILL for one that will not
stop), a start that fails told with its log; and dpex.worker.daemon's
worker that cannot start closing the processes it was given."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from dpex import daemon
from dpex.config import WorkerConfig
from dpex.errors import DpexConfigError, DpexError

SERVER = """
    import sys
    from dpex import daemon

    class Server:
        address, metrics = "h:1", None

        def close(self):
            print("closed", flush=True)

    if __name__ == "__main__":
        daemon.serve_until_signalled(Server(), sys.argv[sys.argv.index("--ready-file") + 1])
        daemon.exit_now(0)
"""


def spawn(tmp_path, code, name="fake_daemon"):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(code))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd()])}
    ready, log = str(tmp_path / "d.ready"), str(tmp_path / "d.log")
    return daemon.spawn([name], ready, log, env), ready, log


def test_a_daemon_serves_until_sigterm_and_closes_its_server(tmp_path):
    process, ready, log = spawn(tmp_path, SERVER)
    served = daemon.await_ready("fake", process, ready, log, timeout_s=60)
    assert served.address == "h:1" and served.metrics_port is None
    daemon.stop_process(process)
    assert process.returncode == 0 and "closed" in served.log_tail()


def test_a_daemon_that_fails_at_start_is_reported_with_its_log(tmp_path):
    process, ready, log = spawn(tmp_path, "raise SystemExit('no data here')\n", name="failing")
    with pytest.raises(DpexError, match="failing exited with code 1 at start:\nno data here"):
        daemon.await_ready("failing", process, ready, log, timeout_s=60)


def test_a_process_that_ignores_sigterm_is_killed():
    process = subprocess.Popen([sys.executable, "-c", "import signal, sys, time\n"
                                "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(1, flush=True)\ntime.sleep(600)"],
                               stdout=subprocess.PIPE)
    assert process.stdout.readline() == b"1\n"  # its handler is set
    daemon.stop_process(process, timeout_s=0.5)
    assert process.returncode == -signal.SIGKILL


def test_a_daemons_end_in_torchs_words():
    assert daemon.exit_reason(12, -9) == "(pid 12) is killed by signal: Killed."
    assert daemon.exit_reason(12, 3) == "(pid 12) exited unexpectedly with exit code 3."


def test_a_process_may_fork_a_daemon_until_grpc_runs_threads():
    result = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        from concurrent import futures
        import grpc
        from dpex.daemon import can_fork
        before = can_fork()
        server = grpc.server(futures.ThreadPoolExecutor(1))
        server.add_insecure_port("127.0.0.1:0")
        server.start()
        print(before, can_fork())
        server.stop(None)
    """)], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["True", "False"], result.stderr


class Pool:
    closed = False

    def close(self):
        self.closed = True


def test_a_worker_that_cannot_start_closes_its_pool_and_forks_nothing(tmp_path):
    from dpex.worker import daemon as worker_daemon
    config = WorkerConfig(dispatcher="127.0.0.1:1", data_paths=(str(tmp_path / "missing"),))
    pool = Pool()
    with pytest.raises(DpexConfigError, match="missing"):
        worker_daemon.run(config, worker_daemon.Forked(pool, str(tmp_path)), None)
    assert pool.closed
    with pytest.raises(DpexConfigError, match="missing"):
        worker_daemon.forked_pool(config)
