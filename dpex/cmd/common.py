"""What the daemons' entry points share: logging, signals, the ready file."""
from __future__ import annotations

import logging
import os
import signal
from typing import Any

import click

from dpex.procutil import die_with_parent_from_env, flush_stdio

LOG_LEVELS = click.Choice(["debug", "info", "warning", "error"], case_sensitive=False)


def setup_logging(level: str, fmt: str = "text") -> None:
    die_with_parent_from_env()  # started by a LocalCluster: stop with it
    from dpex.log import setup
    setup(level, fmt)


def log_options(fn):
    """--log-level and --log-format, for both daemons."""
    fn = click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
                      envvar="DPEX_LOG_FORMAT", show_envvar=True,
                      help="text: `time LEVEL logger message key=value...`; json: one object per line.")(fn)
    return click.option("--log-level", type=LOG_LEVELS, default="info", envvar="DPEX_LOG_LEVEL",
                        show_envvar=True)(fn)


def serve_until_signalled(server: Any, ready_file: str | None) -> None:
    """Writes the ready file, waits for SIGTERM/SIGINT, then closes the server."""
    # The signal's own wake-up byte, not a flag polled: the kernel may deliver the
    # signal to a gRPC thread, and Python runs handlers only in the main thread;
    # the C-level handler writes the byte to this pipe from any thread. (A flag
    # set by the handler would do too, but only when the main thread next runs.)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        # A no-op handler: an Event.set() here could run inside another handler
        # (a burst of SIGTERMs) and wait for a lock the outer one holds, forever.
        signal.signal(sig, lambda signum, _: None)
    old_wakeup = signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    if ready_file:
        tmp = f"{ready_file}.tmp"
        metrics = getattr(server, "metrics", None)
        with open(tmp, "w") as f:  # the address, then the metrics port (if any)
            f.write(server.address + (f"\n{metrics.port}" if metrics is not None else ""))
        os.replace(tmp, ready_file)
    stops = {signal.SIGTERM, signal.SIGINT}
    while not stops & set(os.read(wake_r, 64)):  # a byte per signal: its number
        pass
    signal.set_wakeup_fd(old_wakeup)
    os.close(wake_r)
    os.close(wake_w)
    logging.getLogger("dpex").info("shutting down")
    server.close()


def exit_now(code: int = 0) -> None:
    """Ends a daemon whose server is closed: the exit handlers run (logs,
    multiprocessing's children and files), then the process ends without
    Python tearing down its modules one by one (torch's take half a second
    of CPU, and a daemon has nothing left to keep)."""
    import atexit
    atexit._run_exitfuncs()
    logging.shutdown()
    flush_stdio()
    os._exit(code)


def auth_options(fn):
    """--auth-token-file, --allow-unauthenticated, --tls-cert and --tls-key, for both daemons."""
    fn = click.option("--tls-key", type=click.Path(dir_okay=False), default=None, envvar="DPEX_TLS_KEY",
                      show_envvar=True, help="Private key (PEM) for --tls-cert.")(fn)
    fn = click.option("--tls-cert", type=click.Path(dir_okay=False), default=None, envvar="DPEX_TLS_CERT",
                      show_envvar=True, help="Serve TLS with this certificate chain (PEM).")(fn)
    fn = click.option("--allow-unauthenticated", is_flag=True, envvar="DPEX_ALLOW_UNAUTHENTICATED",
                      show_envvar=True, help="Without a token, still run/accept code shipped from "
                      "non-loopback peers (unsafe).")(fn)
    return click.option("--auth-token-file", type=click.Path(dir_okay=False), default=None,
                        envvar="DPEX_AUTH_TOKEN_FILE", show_envvar=True,
                        help="File holding the shared token every call must carry "
                        "(or set DPEX_AUTH_TOKEN).")(fn)


def tls_ca_option(fn):
    """--tls-ca: for a worker or `dpex status` reaching a TLS dispatcher."""
    return click.option("--tls-ca", type=click.Path(dir_okay=False), default=None, envvar="DPEX_TLS_CA",
                        show_envvar=True, help="Reach the dispatcher over TLS, verifying it against these "
                        "CAs (PEM).")(fn)


def metrics_option(fn):
    return click.option("--metrics-port", type=int, default=None, envvar="DPEX_METRICS_PORT", show_envvar=True,
                        help="Serve Prometheus metrics on this port at /metrics (0 picks a free one) "
                        "[default: none].")(fn)


def message_limit_option(default_mb: int, what: str):
    def add(fn):
        return click.option("--max-message-mb", type=float, default=default_mb, envvar="DPEX_MAX_MESSAGE_MB",
                            show_envvar=True, help=what)(fn)
    return add


def fail(message: str) -> None:
    raise click.ClickException(message)
