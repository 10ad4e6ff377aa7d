"""What the daemons' entry points share: logging and their common flags
(serving until signalled is dpex.daemon's)."""
from __future__ import annotations

import os
import sys
from typing import Any

import click

from dpex.procutil import die_with_parent_from_env

LOG_LEVELS = click.Choice(["debug", "info", "warning", "error"], case_sensitive=False)


def setup_logging(level: str, fmt: str = "text") -> None:
    die_with_parent_from_env()  # started by a LocalCluster: stop with it
    from dpex.log import setup
    setup(level, fmt)


def _json_wanted(args: list[str]) -> bool:
    """Whether ``--log-format json`` (or DPEX_LOG_FORMAT=json) is asked for, read before click parses."""
    for i, arg in enumerate(args):
        if arg == "--log-format" and i + 1 < len(args):
            return args[i + 1] == "json"
        if arg.startswith("--log-format="):
            return arg.split("=", 1)[1] == "json"
    return os.environ.get("DPEX_LOG_FORMAT") == "json"


class DaemonCommand(click.Command):
    """A daemon's command: with ``--log-format json``, a fatal start-up error
    (a bad flag, a port in use, an unreachable dispatcher) is one JSON line
    on stderr, as its log lines are, not click's ``Error: ...``."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if not standalone_mode or not _json_wanted(argv):
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        from dpex.log import fatal_json
        logger = "dpex." + os.path.basename(prog_name or sys.argv[0]).removeprefix("dpex-")  # dpex.worker
        try:
            code = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            click.echo(fatal_json(e.format_message(), logger), err=True)
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo(fatal_json("aborted", logger), err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def version_option(fn):
    """--version: the dpex release, its protocol, and the torch and Python it runs with."""
    def show(ctx: click.Context, _: click.Parameter, value: bool) -> None:
        if value and not ctx.resilient_parsing:
            from dpex.version import describe
            click.echo(f"{ctx.info_name} {describe().removeprefix('dpex ')}")
            ctx.exit()
    return click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=show,
                        help="Show the version and exit.")(fn)


def log_options(fn):
    """--log-level and --log-format, for both daemons."""
    fn = click.option("--log-format", type=click.Choice(["text", "json"]), default="text",
                      envvar="DPEX_LOG_FORMAT", show_envvar=True,
                      help="text: `time LEVEL logger message key=value...`; json: one object per line.")(fn)
    return click.option("--log-level", type=LOG_LEVELS, default="info", envvar="DPEX_LOG_LEVEL",
                        show_envvar=True)(fn)


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


class ByteSize(click.ParamType):
    """A number of bytes: 1073741824, 1G, 512M or 64K (powers of 1024)."""
    name = "bytes"
    _UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in self._UNITS else ""
        try:
            number = float(text[:len(text) - len(unit)])
        except ValueError:
            self.fail(f"{value!r} is not a size (e.g. 1073741824, 1G, 512M)", param, ctx)
        if number < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return int(number * self._UNITS[unit])


def fail(message: str) -> None:
    """Exits with ``message``, naming the flags that came from environment variables (DPEX_PORT is
    read by both daemons: a worker started in the dispatcher's shell gets its port)."""
    ctx = click.get_current_context(silent=True)
    if ctx is not None:
        from_env = [f"--{p.name.replace('_', '-')}={ctx.params.get(p.name)!r} from ${p.envvar}"
                    for p in ctx.command.params if isinstance(p.envvar, str)
                    and ctx.get_parameter_source(p.name) is click.core.ParameterSource.ENVIRONMENT]
        if from_env:
            message += f" (set from the environment: {', '.join(from_env)})"
    raise click.ClickException(message)
